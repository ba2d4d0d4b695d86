"""Next tokens from a step's logits, every row at once: where the last stage samples, so a step ships token ids.

A step's rows each carry their own settings (``RowSampling``: greedy or temperature, min-p, top-k, top-p, seed and
the position of the token drawn).  Greedy rows are one argmax; the sampled rows are filtered together in vLLM's
order (temperature, min-p, top-k, top-p) and drawn together.  Top-p is exact without a full sort of the
vocabulary per row: the most likely candidates are taken with ``topk`` (256, then 4096) and a row whose kept
mass covers ``top_p`` among them is done; only the rest are sorted whole (a 151 936-token sort costs ~14 ms a
row on a CPU core, a top-256 ~0.4 ms).

The draw is inverse-CDF over the kept tokens in token-id order with one uniform per row, which is a hash of the
row's seed and its token's position (splitmix64 in int64 arithmetic): a seeded request gets the same token
whatever else is in its step, on whichever process samples it (the last stage, or the engine when the step
ships logits), and again after a failover resumes it on another pipeline.  Summed in id order, the kept tokens'
probabilities give the same cumulative sums whether a row was resolved among candidates or over the whole
vocabulary, so the path a row took never changes its token.

A row whose logits hold NaN or +inf gets a negative code (``NAN``, ``POSINF``) instead of a token: only its
request fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MODE_GREEDY", "MODE_LOGITS", "MODE_SAMPLE", "MODE_SKIP", "NAN", "PARAMS_AT", "POSINF", "TABLE_ROWS", "Params", "RowSampling",
    "sample_rows", "step_params",
]  # fmt: skip

NAN, POSINF = -1, -2  # a row's code when its logits cannot be sampled from
MODE_GREEDY, MODE_SAMPLE, MODE_LOGITS = 0, 1, 2  # argmax; draw here; ship the logits (the engine's processors)
# a row whose token is never used (a prompt's chunk before its last, a request gone): the head skips it, its token 0
MODE_SKIP = 3
# a step's table (the engine's int64 [height, rows]): slot, start, length, every position's logits, then these
PARAMS_AT = 4
PARAM_ROWS = 7  # mode, seed, position, temperature, top_p, min_p, top_k
TABLE_ROWS = PARAMS_AT + PARAM_ROWS
CANDIDATES = (256, 4096)  # the widths tried before a row's full sort (benchmarks/sampling_rows.py)
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with its bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


@dataclass(frozen=True)
class RowSampling:
    """One row's settings: ``temperature`` 0 is greedy; ``seed`` and ``position`` (of the token drawn) fix its
    draw; ``mode`` ``MODE_LOGITS``: the row's logits must go back (its request's processors need them);
    ``MODE_SKIP``: its token is never used (no logits are computed for it)."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    position: int = 0
    mode: int = MODE_GREEDY


@dataclass(frozen=True)
class Params:
    """The rows' settings as tensors [R] (what ``sample_rows`` reads, and what a step's table carries)."""

    mode: torch.Tensor  # int64
    seed: torch.Tensor  # int64
    position: torch.Tensor  # int64
    temperature: torch.Tensor  # float64
    top_p: torch.Tensor  # float64
    min_p: torch.Tensor  # float64
    top_k: torch.Tensor  # int64

    @classmethod
    def of(cls, rows: Sequence[RowSampling]) -> Params:
        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        def floats(values: Sequence[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float64)

        return cls(
            ints([r.mode for r in rows]), ints([r.seed for r in rows]), ints([r.position for r in rows]),
            floats([r.temperature for r in rows]), floats([r.top_p for r in rows]), floats([r.min_p for r in rows]),
            ints([r.top_k for r in rows]),
        )  # fmt: skip

    def table(self) -> torch.Tensor:
        """int64 [PARAM_ROWS, R]; the floats travel as their float64 bit patterns."""
        bits = [t.view(torch.int64) for t in (self.temperature, self.top_p, self.min_p)]
        return torch.stack([self.mode, self.seed, self.position, *bits, self.top_k])

    @classmethod
    def from_table(cls, rows: torch.Tensor) -> Params:
        """From ``table()``'s rows (on any device; read back on the CPU, where sampling's bookkeeping runs)."""
        rows = rows.cpu()
        mode, seed, position, temperature, top_p, min_p, top_k = (rows[i].contiguous() for i in range(PARAM_ROWS))
        temperature, top_p, min_p = (t.view(torch.float64) for t in (temperature, top_p, min_p))
        return cls(mode, seed, position, temperature, top_p, min_p, top_k)

    def select(self, index: torch.Tensor) -> Params:
        return dataclasses.replace(self, **{name: getattr(self, name)[index] for name in self.__dataclass_fields__})


def sample_rows(logits: torch.Tensor, params: Params) -> torch.Tensor:
    """Each row's next token from ``logits`` [R, V], int64 [R] on the CPU (``NAN``/``POSINF`` for a row that cannot
    be sampled from).  Rows of temperature 0 are argmax, as ``generate(do_sample=False)``."""
    rows, vocab = logits.shape
    out = torch.zeros(rows, dtype=torch.int64)
    code = _bad_rows(logits)
    greedy = (params.temperature <= 0) & (code == 0)
    sampled = (params.temperature > 0) & (code == 0)
    if bool(greedy.any()):
        out[greedy] = _rows(logits, greedy).argmax(-1).cpu()
    if bool(sampled.any()):
        out[sampled] = _sample(_rows(logits, sampled), params.select(sampled), vocab)
    return torch.where(code != 0, code, out)


def _rows(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``values``' rows where ``chosen`` [R] (a CPU mask): no copy of a vocabulary a row when every row is."""
    return values if bool(chosen.all()) else values[chosen.to(values.device)]


def _bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R]: 0 for a row that can be sampled from, ``NAN`` or ``POSINF`` (-inf alone is a token made
    impossible).  One reduction first: a sum is finite iff every value is."""
    sums = logits.sum(-1, dtype=torch.float32)
    code = torch.zeros(logits.shape[0], dtype=torch.int64)
    broken = ~torch.isfinite(sums).cpu()
    if bool(broken.any()):
        bad = logits[broken.to(logits.device)]
        nan, posinf = torch.isnan(bad).any(-1).cpu(), torch.isposinf(bad).any(-1).cpu()
        code[broken] = torch.where(nan, NAN, torch.where(posinf, POSINF, 0))
    return code


def _sample(logits: torch.Tensor, params: Params, vocab: int) -> torch.Tensor:
    """Sampled rows: temperature, min-p, then a draw over the whole vocabulary or over the head top-k and top-p
    keep."""
    device = logits.device
    probs = torch.softmax(logits.float() / params.temperature.to(device, torch.float32)[:, None], dim=-1)
    if bool((params.min_p > 0).any()):  # the top token always stays
        floor = params.min_p.to(device, torch.float32) * probs.max(-1).values
        probs = torch.where(probs < floor[:, None], 0.0, probs)
    uniform = _uniform(params.seed, params.position)
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    head = ((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0)
    if bool((~head).any()):
        out[~head] = _draw(_rows(probs, ~head), None, uniform[~head])
    if bool(head.any()):
        out[head] = _head(_rows(probs, head), params.select(head), uniform[head], vocab)
    return out


def _head(probs: torch.Tensor, params: Params, uniform: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows whose kept set is a head of the ranking (top-k, top-p): among the ``CANDIDATES`` most likely first, the
    rows not resolved there among more, then sorted whole."""
    device = probs.device
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    todo = torch.arange(probs.shape[0])
    top_k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab + 1)  # vocab + 1: no top-k
    total = probs.sum(-1).cpu()  # the kept mass after min-p (top-k's is counted among the candidates)
    widths = [*CANDIDATES, vocab]
    while todo.numel():
        real = params.top_k[todo] > 0
        width = min(vocab, max(widths.pop(0), int(top_k[todo][real].max()) if bool(real.any()) else 0))
        among = probs if todo.numel() == probs.shape[0] else probs[todo.to(device)]
        whole = width == vocab
        # most likely first (the whole row: a sort, which beats a top-k of every token)
        values, ids = among.sort(-1, descending=True) if whole else among.topk(width, dim=-1)
        kept, done, covered = _keep(values, top_k[todo], params.top_p[todo], total[todo], whole)
        if bool(done.any()):
            chosen = _rows(torch.where(kept, values, 0.0), done)
            if whole:  # back in token-id order by a scatter, not a second sort
                chosen = torch.zeros_like(chosen).scatter_(1, _rows(ids, done), chosen)
            out[todo[done]] = _draw(chosen, None if whole else _rows(ids, done), uniform[todo[done]])
        if bool((covered[~done] < params.top_p[todo][~done] / 4).all()):
            widths = [vocab]  # far from covered (a flat row): more candidates would not do, sort at once
        todo = todo[~done]
    return out


def _keep(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor, whole: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which of the candidates ``values`` [N, W] (most likely first) top-k and top-p keep, which rows are
    resolved (their kept set lies among the candidates), and the share of top-p's mass the candidates hold.
    Top-p's mass is among the tokens min-p and top-k left."""
    device, width = values.device, values.shape[1]
    kth = values.gather(1, (top_k.clamp(max=width) - 1).to(device)[:, None])
    kept = values >= kth  # a tie with the k-th stays, as ``probs < kth`` drops only the smaller
    within_k = top_k <= width
    # top-k's kept mass summed in rank order (a prefix of the candidates, whatever their number)
    in_k = torch.where(kept, values, 0.0).cumsum(-1)[:, -1]
    mass = torch.where(within_k.to(device), in_k, total.to(device, torch.float32))
    nucleus = top_p < 1.0
    done = within_k | torch.tensor(whole).expand_as(within_k)
    covered = torch.ones(values.shape[0], dtype=torch.float32)
    if bool(nucleus.any()):
        share = torch.where(kept, values, 0.0) / mass[:, None]
        running = share.cumsum(-1)
        before = running - share  # the mass of the tokens ranked above each one
        limit = top_p.to(device, torch.float32)[:, None]
        kept &= (before < limit) | ~nucleus.to(device)[:, None]  # the top token always stays
        covered = running[:, -1].cpu()
        done |= nucleus & (covered >= top_p.float())  # the next token's mass before it covers top_p
    return kept, done, covered


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over each row's kept tokens (``probs`` [N, W], 0 where dropped, for token ``ids`` [N, W]; None:
    the whole vocabulary in id order) in token-id order, so the sums, and the token, are the same whichever
    candidates a row was drawn among."""
    if ids is not None:
        order = ids.argsort(-1)
        ids, probs = ids.gather(1, order), probs.gather(1, order)
    running = probs.double().cumsum(-1)
    total = running[:, -1:].contiguous()
    target = uniform.to(probs.device)[:, None] * total
    picked = torch.searchsorted(running, target, right=True)
    last = torch.searchsorted(running, total, right=False)  # the last kept token (u * total rounded up to total)
    picked = torch.minimum(picked, last)
    return (picked if ids is None else ids.gather(1, picked)).squeeze(1).cpu()


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in int64 arithmetic (wrapping products; shifts made logical by their masks)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """float64 [R] in [0, 1): one draw per row, a function of its seed and its token's position alone."""
    z = _mix(seed.cpu() ^ _mix(position.cpu() * _GOLDEN + _GOLDEN))
    return ((z >> 11) & ((1 << 53) - 1)).double() * 2.0**-53


def step_params(table: torch.Tensor) -> Params | None:
    """The rows' sampling settings a step's ``table`` carries; None when the step must ship its logits (a table
    without them, or a row in ``MODE_LOGITS``)."""
    if table.shape[0] < TABLE_ROWS:
        return None
    params = Params.from_table(table[PARAMS_AT:TABLE_ROWS])
    return None if bool((params.mode == MODE_LOGITS).any()) else params


def sampled_rows(params: Params | None) -> torch.Tensor | None:
    """int64 [K]: the rows whose token is used (``MODE_SKIP``'s are not), the only ones the head computes; None
    for every row (a step that ships its logits, or one whose rows all sample)."""
    if params is None:
        return None
    kept = params.mode != MODE_SKIP
    return None if bool(kept.all()) else kept.nonzero().flatten()
