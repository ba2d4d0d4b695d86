"""The SSH transport reads a command's output to its end, even when sshd reports the exit status first.

The tests of a deadline run `collect` on a simulated clock (conftest's `clock`): a deadline is judged against
the fake channel's own sequence of polls (on a loaded machine a 10 ms sleep once lasted longer than a 50 ms
grace, which then ended before the fake's output had arrived)."""

from collections import deque

import pytest

from raycluster_cli.transport import ssh, sshio

from .conftest import Clock


class ExitFirstChannel:
    """A channel on which the exit status arrives before the second chunk of stdout (as OpenSSH may do)."""

    def __init__(self, chunks: list[bytes], eof: bool = True) -> None:
        self.pending = deque(chunks)
        self.buffer = bytearray()
        self.polls = 0
        self.eof = eof

    def settimeout(self, _: float) -> None:
        pass

    def _tick(self) -> None:
        self.polls += 1
        if self.polls % 5 == 0 and self.pending:  # data trickles in slowly
            self.buffer += self.pending.popleft()

    def recv_ready(self) -> bool:
        self._tick()
        return bool(self.buffer)

    def recv(self, size: int) -> bytes:
        data, self.buffer = bytes(self.buffer[:size]), self.buffer[size:]
        return data

    def recv_stderr_ready(self) -> bool:
        return False

    def recv_stderr(self, size: int) -> bytes:
        return b""

    def exit_status_ready(self) -> bool:
        return True  # the command has exited from the start

    @property
    def eof_received(self) -> bool:
        return self.eof and not self.pending and not self.buffer

    def recv_exit_status(self) -> int:
        return 0


def test_output_after_the_exit_status_is_kept() -> None:
    lines = [b"1: lo inet 127.0.0.1/8\n", b"2: eth0 inet 192.0.2.11/24\n", b"3: eth1 inet 198.51.100.1/24\n"]
    result = sshio.collect(ExitFirstChannel(lines), 10, "192.0.2.11")  # type: ignore[arg-type]
    assert result.stdout == b"".join(lines).decode()


def test_no_eof_ends_after_the_grace_period(clock: Clock) -> None:
    """A command that exited but whose output never ends (a daemon holds its stdout): the output that came
    after the exit status is kept, and the read ends once the grace has passed, not before."""
    started = clock.now
    result = sshio.collect(ExitFirstChannel([b"started\n"], eof=False), 10, "192.0.2.11")  # type: ignore[arg-type]
    assert result.stdout == "started\n" and result.rc == 0
    assert sshio.EOF_GRACE_S < clock.now - started < sshio.EOF_GRACE_S + 0.1


class DroppingTransport:
    def is_active(self) -> bool:
        return True

    def open_session(self, **_: object) -> None:
        raise EOFError()


class DroppingClient:
    closed = False

    def get_transport(self) -> DroppingTransport:
        return DroppingTransport()

    def close(self) -> None:
        DroppingClient.closed = True


def test_a_connection_that_drops_under_a_command_is_one_transport_error_and_is_forgotten(tmp_path) -> None:
    import pytest

    from raycluster_cli.errors import TransportError

    transport = ssh.SSHTransport("192.0.2.11", user="root", known_hosts_file=str(tmp_path / "known_hosts"))
    transport._client = DroppingClient()  # type: ignore[assignment]
    with pytest.raises(TransportError) as caught:
        transport.run("docker run ...")
    assert "192.0.2.11" in caught.value.one_line() and "dropped" in caught.value.one_line()
    assert DroppingClient.closed and transport._client is None


class TrickleThenSilent(ExitFirstChannel):
    """A running command that sends its chunks, then nothing, and never exits (a hung `docker logs`)."""

    def exit_status_ready(self) -> bool:
        return False

    closed = False


def test_streamed_output_goes_to_the_sink_as_it_arrives_and_is_not_kept() -> None:
    chunks: list[tuple[str, bytes]] = []
    lines = [b"a" * 10, b"b" * 10]
    result = sshio.collect(ExitFirstChannel(lines), 10, "192.0.2.11", on_output=lambda s, d: chunks.append((s, d)))  # type: ignore[arg-type]
    assert b"".join(d for _, d in chunks) == b"".join(lines) and {s for s, _ in chunks} == {"stdout"}
    assert (result.stdout, result.rc) == ("", 0)


def test_a_stream_silent_past_its_stall_deadline_fails_naming_host_and_command(clock: Clock) -> None:
    started = clock.now
    with pytest.raises(sshio.Stalled) as caught:
        sshio.collect(
            TrickleThenSilent([b"x"]), 30, "192.0.2.11", "docker logs c", on_output=lambda s, d: None, stall_s=0.5
        )  # type: ignore[arg-type]
    # the stall counts from the last chunk (it came on the 5th turn, after 4 sleeps of 10 ms), not from the start
    assert 0.54 < clock.now - started < 0.56
    assert "192.0.2.11" in caught.value.one_line() and "docker logs c" in caught.value.one_line()


def test_each_line_of_stdout_is_handed_over_as_soon_as_it_is_whole_and_all_of_it_is_kept() -> None:
    """A receive command says PUBLISHED long before it ends: the operator must hear it then, not at the end."""
    chunks = [b"Loaded ima", b"ge: img:1\nraycluster: archive", b" whole\n", b"sha256:abc"]
    channel = ExitFirstChannel(chunks)
    heard: list[tuple[str, int]] = []
    lines = sshio.Lines(lambda line: heard.append((line, len(channel.pending))))
    result = sshio.collect(channel, 10, "192.0.2.11", on_output=lines)  # type: ignore[arg-type]
    # Each line when the chunk that ends it had come (chunks still pending then), the unfinished last one never.
    assert heard == [("Loaded image: img:1", 2), ("raycluster: archive whole", 1)]
    assert result.stdout == "" and lines.result(result.rc).stdout == b"".join(chunks).decode()


def test_the_ssh_transports_run_and_feed_hand_lines_over_and_keep_the_output(tmp_path) -> None:
    import io

    from .test_transport_deadlines import DoneChannel, OpenClient

    for call in ("run", "feed"):
        transport = ssh.SSHTransport("192.0.2.15", known_hosts_file=str(tmp_path / "kh"), connect_timeout=4)
        channel = DoneChannel()
        channel.data = b"one\ntwo\nthree"
        channel.sendall = lambda data: None  # type: ignore[attr-defined]
        channel.send_ready = lambda: True  # type: ignore[attr-defined]
        channel.send = lambda data: len(data)  # type: ignore[attr-defined]
        transport._client = OpenClient(channel)  # type: ignore[assignment]
        heard: list[str] = []
        if call == "run":
            result = transport.run("true", on_line=heard.append)
        else:
            result = transport.feed("cat", io.BytesIO(b"x" * 10), on_line=heard.append)
        assert heard == ["one", "two"] and result.stdout == "one\ntwo\nthree" and result.rc == 0, call
