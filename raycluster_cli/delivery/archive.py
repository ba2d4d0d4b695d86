"""`docker save | compressor > FILE` as one pipeline that fails whole, with the real cause.

If either process dies (a compressor that crashes, a disk that fills, `docker save` losing its daemon, an
interrupt), the other is stopped too, the partial file is removed, and the error names the process that
failed with its exit status and its own words (e.g. "gzip: stdout: No space left on device") — never a
bare BrokenPipeError. The operator process copies the bytes itself so that it can report progress.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from raycluster_cli.errors import OperationError

CHUNK = 1 << 20
_STOP_S = 5.0  # after SIGTERM, this long before SIGKILL


@dataclass(frozen=True)
class Step:
    """One process of the pipeline: its argv and the name errors use for it."""

    argv: list[str]
    name: str


class PipelineError(OperationError):
    """A step of the pipeline failed: `step` names it, the message carries its exit status and stderr."""

    def __init__(self, message: str, hint: str, step: str) -> None:
        super().__init__(message, hint)
        self.step = step


def save_compressed(
    source: Step,
    compressor: Step,
    dest: Path,
    on_bytes: Callable[[int], None] = lambda n: None,
    *,
    what: str = "the image archive",
) -> int:
    """Run `source | compressor > dest` (dest written via dest.partial, renamed when whole); bytes read."""
    partial = dest.with_name(dest.name + ".partial")
    with (
        tempfile.TemporaryFile() as source_err,
        tempfile.TemporaryFile() as compress_err,
        partial.open("wb") as out,
    ):
        producer = subprocess.Popen(source.argv, stdout=subprocess.PIPE, stderr=source_err)
        try:
            consumer = subprocess.Popen(compressor.argv, stdin=subprocess.PIPE, stdout=out, stderr=compress_err)
        except BaseException:
            _stop(producer)
            partial.unlink(missing_ok=True)
            raise
        ok = False
        try:
            copied, broken = _copy(producer, consumer, on_bytes)
            if broken:
                _stop(producer)  # the compressor is gone: nothing will read docker save's output
            _close(consumer.stdin)
            consumer.wait()
            producer.wait()
            _raise_failure(source, producer, source_err, compressor, consumer, compress_err, dest, broken, what)
            out.flush()
            os.fsync(out.fileno())
            ok = True
        finally:
            if not ok:
                _stop(producer)
                _stop(consumer)
                partial.unlink(missing_ok=True)
    os.replace(partial, dest)
    return copied


def _copy(
    producer: subprocess.Popen[bytes], consumer: subprocess.Popen[bytes], on_bytes: Callable[[int], None]
) -> tuple[int, bool]:
    """Copy producer → consumer until EOF; (bytes copied, True when the consumer stopped reading)."""
    assert producer.stdout is not None and consumer.stdin is not None
    copied = 0
    while chunk := producer.stdout.read(CHUNK):
        try:
            consumer.stdin.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return copied, True
        copied += len(chunk)
        on_bytes(copied)
    return copied, False


def _raise_failure(
    source: Step,
    producer: subprocess.Popen[bytes],
    source_err: IO[bytes],
    compressor: Step,
    consumer: subprocess.Popen[bytes],
    compress_err: IO[bytes],
    dest: Path,
    broken: bool,
    what: str,
) -> None:
    """The first real cause: the compressor when it died (it makes the source fail too), else the source."""
    if consumer.returncode != 0 or broken:
        said = _said(compress_err)
        status = _status(consumer.returncode) if consumer.returncode else "stopped reading its input early"
        full = "no space left" in said.lower()
        hint = (
            f"free space in {dest.parent} (df -h {dest.parent}), or set RAYCLUSTER_STATE_DIR to a larger disk"
            if full
            else f"check that `{' '.join(compressor.argv)}` works on this machine"
        )
        cause = f"no space left on {dest.parent}" if full else f"{compressor.name} {status}"
        raise PipelineError(f"writing {what} failed: {cause}" + (f" ({said})" if said else ""), hint, compressor.name)
    if producer.returncode != 0:
        said = _said(source_err)
        raise PipelineError(
            f"writing {what} failed: {source.name} {_status(producer.returncode)}" + (f" ({said})" if said else ""),
            f"check that `{' '.join(source.argv)}` works on this machine",
            source.name,
        )


def _said(err: IO[bytes]) -> str:
    """The last line a process wrote on stderr (one line, at most 200 characters)."""
    err.seek(0)
    lines = [line.strip() for line in err.read()[-4096:].decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _status(returncode: int | None) -> str:
    if returncode is None:
        return "did not finish"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
            stream.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate (then kill) `process` if it still runs, and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for stream in (process.stdin, process.stdout):
        _close(stream)
