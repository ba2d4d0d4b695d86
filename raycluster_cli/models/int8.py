"""A stage's products with int8 weights on a CPU (``serve --quantize int8``): half the bytes of bfloat16 streamed
per step, which is what a decode step on a CPU waits for.

Each matrix is stored as int8 with one scale per output row (symmetric, the row's largest magnitude maps to 127),
packed for fbgemm's int8 kernels (VNNI where the CPU has it).  A step's rows are quantized on the fly, each row
with its own scale: fbgemm's dynamic product takes one scale for the whole input, so one row with large values
would coarsen every other row's numbers and a request's tokens would depend on who shares its step.  Each row is
divided by its own largest magnitude first and an anchor row holding +1 and -1 is appended, so the input's range
is always [-1, 1], the quantization the same for every step, and each row's result that row's alone once
multiplied back by its scale.  Measured on the lab's CPU (AVX-512 VNNI, one thread, Qwen2.5-0.5B's MLP matrices):
16 rows 0.48 ms against 0.70 for bfloat16's packed form (the 151 936-row head 19 ms against 29), 256 rows 9.2
against 10.6; the products' error ~1 % of their largest value (bfloat16's: 0.35 %).  Where the CPU has no VNNI,
inputs use 7 bits (fbgemm's ``reduce_range``: its 8-bit products could saturate there).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from functools import cache

import torch
from torch import nn

from raycluster_cli.models.cpu import cpu_flags
from raycluster_cli.models.matmuls import Matmuls

_TINY = 1e-12  # a row of zeros keeps scale 1e-12 and comes out as zeros


VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # 8-bit dot products that cannot saturate


@cache
def has_vnni() -> bool:
    """Whether this CPU has 8-bit dot products that cannot saturate (AVX-512 VNNI, AVX-VNNI or AMX)."""
    return not cpu_flags().isdisjoint(VNNI_FLAGS)


def available() -> bool:
    """Whether this torch has fbgemm's dynamic int8 product."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def _prepack(linear: nn.Linear) -> torch.Tensor:
    weight = linear.weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(_TINY).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated (torchao's replacement is not
        warnings.simplefilter("ignore", UserWarning)  # in the node image); fbgemm's kernels behind them are current
        quantized = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    packed: torch.Tensor = torch.ops.quantized.linear_prepack(quantized, None)
    return packed


class Int8Matmuls(Matmuls):
    """``apply(linear, x)`` = ``linear(x)`` with the linear's int8 copy; the original weights are dropped (the
    bias is kept), so the stage holds half the bytes of bfloat16 (a quarter of float32's)."""

    def __init__(self, linears: Iterable[nn.Linear]) -> None:
        super().__init__()
        if not available():
            raise ValueError("this torch has no fbgemm int8 kernels: serve without --quantize")
        self.packed: dict[nn.Linear, torch.Tensor] = {}
        self.weight_bytes = 0
        with torch.inference_mode():
            for linear in linears:
                self.packed[linear] = _prepack(linear)
                self.weight_bytes += linear.weight.numel()
                linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
        self.reduce_range = not has_vnni()
        self._anchors: dict[int, torch.Tensor] = {}

    def _anchor(self, width: int) -> torch.Tensor:
        if width not in self._anchors:
            anchor = torch.zeros(1, width)
            anchor[0, 0], anchor[0, -1] = 1.0, -1.0
            self._anchors[width] = anchor
        return self._anchors[width]

    def apply(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        flat = x.reshape(-1, width).float()
        scales = flat.abs().amax(dim=1, keepdim=True).clamp_min(_TINY)
        inputs = torch.cat([flat / scales, self._anchor(width)])
        out = torch.ops.quantized.linear_dynamic(inputs, self.packed[linear], self.reduce_range)[:-1].mul_(scales)
        if linear.bias is not None:
            out += linear.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    @property
    def packed_bytes(self) -> int:
        return 0  # the int8 copies replace the weights rather than sit beside them

    def over(self, linears: Sequence[nn.Linear]) -> Matmuls:
        return Int8Matmuls(linears) if linears else Matmuls()

    def describe(self) -> dict[str, str]:
        return {"all": "int8 weights (fbgemm), rows quantized each on its own"}
