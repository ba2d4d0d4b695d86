"""A stage's load reads only its own tensors: the rest of a large checkpoint never enters memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ..bench_checkpoints import save_tensors

# The peak resident memory, in MiB, that loading (and touching every value of) the named tensors adds: the peak is
# reset first (clear_refs 5), so what importing torch held for a moment is not counted against the load.
_PEAK = """
import sys
from pathlib import Path
from raycluster_cli.models.tensorfile import load_tensors
def peak_kib():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1])
Path("/proc/self/clear_refs").write_text("5")
before = peak_kib()
loaded = load_tensors(sys.argv[1], sys.argv[2:])
total = sum(float(t.double().sum()) for t in loaded.values())
print((peak_kib() - before) // 1024)
"""


def _peak_mib(path: Path, *names: str) -> int:
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), *names], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_loading_a_small_tensor_does_not_read_the_large_one(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_tensors(path, {"big": torch.ones(32 << 20, dtype=torch.float32), "small": torch.ones(256)})  # 128 MiB
    assert _peak_mib(path, "small") < 16
    assert _peak_mib(path, "big") >= 100  # the measure sees a tensor that is read
