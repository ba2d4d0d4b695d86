"""``models.sampling.sample_rows``: the batched draw the last stage (and the engine, for a step that ships logits)
runs.  Its kept sets are checked against the per-row definition the service used before (temperature, min-p,
top-k, top-p in vLLM's order) and against transformers' own warpers; its draws against the filtered softmax."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models import sampling as sampling_module  # noqa: E402
from raycluster_cli.models.sampling import NAN, POSINF, Params, RowSampling, sample_rows  # noqa: E402


def _filtered(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """One row's probabilities as the per-row sampler defined them (every kept token's share, 0 elsewhere)."""
    probs = torch.softmax(logits.float() / row.temperature, dim=-1)
    if row.min_p > 0.0:
        probs = torch.where(probs < row.min_p * probs.max(), 0.0, probs)
    if 0 < row.top_k < probs.numel():
        kth = probs.topk(row.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if row.top_p < 1.0:
        probs = probs / probs.sum()
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[before >= row.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()


def _draws(logits: torch.Tensor, row: RowSampling, n: int, first_seed: int = 0) -> torch.Tensor:
    """``n`` draws of one row's token, one seed each, all in one batch."""
    rows = [RowSampling(row.temperature, row.top_p, row.min_p, row.top_k, first_seed + s, row.position, row.mode)
            for s in range(n)]  # fmt: skip
    return sample_rows(logits.expand(n, -1), Params.of(rows))


def _kept(logits: torch.Tensor, row: RowSampling, n: int = 3000) -> set[int]:
    return set(_draws(logits, row, n).tolist())


def test_greedy_rows_are_argmax_and_sampled_rows_beside_them_are_drawn() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 4
    rows = [RowSampling(), RowSampling(1.0, seed=3), RowSampling(), RowSampling(0.5, top_k=3, seed=9), RowSampling()]
    got = sample_rows(logits, Params.of(rows))
    assert got.dtype == torch.int64 and got.shape == (5,)
    assert [got[i] for i in (0, 2, 4)] == [logits[i].argmax() for i in (0, 2, 4)]
    assert int(got[3]) in set(logits[3].topk(3).indices.tolist())


CRAFTED = torch.tensor([0.1, 2.0, 1.9, -1.0, 1.0, 0.5, -3.0, 1.5])


@pytest.mark.parametrize(
    "row",
    [
        RowSampling(1.0, top_k=2),
        RowSampling(1.0, top_k=5),
        RowSampling(1.0, min_p=0.3),
        RowSampling(1.0, top_p=0.6),
        RowSampling(0.7, top_p=0.9),
        RowSampling(1.3, top_p=0.8, min_p=0.1, top_k=6),
        RowSampling(1.0, top_p=0.3),  # only the top token is within top_p
        RowSampling(1.0, top_k=1),
    ],
)
def test_kept_sets_equal_the_per_row_definition(row: RowSampling) -> None:
    assert _kept(CRAFTED, row) == set(torch.nonzero(_filtered(CRAFTED, row)).flatten().tolist())


def test_top_k_and_min_p_keep_the_tokens_transformers_keeps() -> None:
    """The tokens a draw can give: those transformers' ``TopKLogitsWarper`` / ``MinPLogitsWarper`` leave finite."""
    hf = transformers.generation.logits_process
    for row, warper in (
        (RowSampling(1.0, top_k=2), hf.TopKLogitsWarper(2)),
        (RowSampling(1.0, min_p=0.3), hf.MinPLogitsWarper(0.3)),
    ):
        kept = warper(torch.tensor([[0]]), CRAFTED.clone()[None])[0]
        assert _kept(CRAFTED, row) == {i for i in range(8) if torch.isfinite(kept[i])}, row


def test_top_p_beyond_the_candidates_is_the_full_sorts_answer() -> None:
    """A flat tail: top-p 0.9 of 20 000 near-equal tokens keeps ~18 000, more than any candidate width, so the row
    is sorted whole; the kept set is still the definition's (the draws never leave it, and reach far into it)."""
    logits = torch.linspace(0.0, 0.5, 20_000)
    row = RowSampling(1.0, top_p=0.9)
    want = set(torch.nonzero(_filtered(logits, row)).flatten().tolist())
    assert len(want) > max(sampling_module.CANDIDATES)
    drawn = _kept(logits, row, 4000)
    assert drawn <= want and len(drawn) > 3000 and min(drawn) < min(want) + 200


def test_a_seeded_row_gets_its_token_alone_or_in_any_batch_in_any_order() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 2000, generator=gen) * 2.5
    logits[1] = torch.linspace(0.0, 0.3, 2000)  # resolved by the full sort, the others among candidates
    rows = [
        RowSampling(0.8, top_p=0.95, seed=11, position=7, mode=1),
        RowSampling(1.0, top_p=0.9, seed=12, position=3, mode=1),
        RowSampling(),
        RowSampling(1.2, top_k=50, seed=-4, position=100, mode=1),
        RowSampling(0.9, min_p=0.05, seed=2**62, position=1, mode=1),
        RowSampling(1.0, seed=11, position=8, mode=1),
    ]
    together = sample_rows(logits, Params.of(rows)).tolist()
    alone = [int(sample_rows(logits[i : i + 1], Params.of([rows[i]]))[0]) for i in range(6)]
    assert together == alone
    for order in itertools.islice(itertools.permutations(range(6)), 0, 720, 97):
        index = torch.tensor(order)
        assert sample_rows(logits[index], Params.of([rows[i] for i in order])).tolist() == [together[i] for i in order]
    # the candidates' path and the full sort's give the same token: a row's path never changes its draw
    widths = sampling_module.CANDIDATES
    try:
        sampling_module.CANDIDATES = ()
        assert sample_rows(logits, Params.of(rows)).tolist() == together
    finally:
        sampling_module.CANDIDATES = widths


def test_the_draw_depends_on_seed_and_position() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any two draws that share their uniform collide
    row = RowSampling(1.0, seed=1, position=5)
    base = int(sample_rows(logits, Params.of([row]))[0])
    others = [RowSampling(1.0, seed=s, position=p) for s, p in ((2, 5), (1, 6), (-1, 5), (1, 4))]
    assert all(int(sample_rows(logits, Params.of([o]))[0]) != base for o in others)


@pytest.mark.parametrize(
    "row",
    [RowSampling(0.7, top_p=0.9), RowSampling(1.0), RowSampling(1.5, min_p=0.05, top_k=6), RowSampling(0.5)],
)
def test_draws_over_many_seeds_follow_the_filtered_softmax(row: RowSampling) -> None:
    """A chi-square over 20 000 seeds: ~df ± a few sqrt(2 df) when right; a wrong temperature (0.7 for 1.0) or
    an unfiltered tail gives hundreds, and a token outside the kept set fails at once."""
    n = 20_000
    want = _filtered(CRAFTED, row)
    counts = torch.bincount(_draws(CRAFTED, row, n, first_seed=1000), minlength=8).double()
    kept = want > 0
    assert counts[~kept].sum() == 0
    expected = want[kept].double() * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 35.0, (chi2, counts.tolist(), expected.tolist())
    wrong = RowSampling(row.temperature * 1.4, row.top_p, row.min_p, row.top_k)
    other = _filtered(CRAFTED, wrong)[kept].double() * n
    assert float(((counts[kept] - other) ** 2 / other).sum()) > 100.0  # the test tells a wrong temperature apart


def test_a_row_of_nan_or_plus_inf_fails_alone() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :5] = float("-inf")  # tokens made impossible, not an error
    rows = [RowSampling(1.0, seed=1), RowSampling(1.0, seed=2), RowSampling(), RowSampling(0.9, top_p=0.5, seed=3)]
    got = sample_rows(logits, Params.of(rows)).tolist()
    assert got[1] == NAN and got[2] == POSINF and got[0] >= 0 and got[3] >= 5
    assert got[0] == int(sample_rows(logits[:1], Params.of(rows[:1]))[0])


def test_the_settings_travel_in_an_int64_table_and_come_back_equal() -> None:
    rows = [RowSampling(0.8, 0.95, 0.05, 40, -(2**63), 12, 1), RowSampling(seed=2**63 - 1, position=3)]
    params = Params.of(rows)
    table = params.table()
    assert table.dtype == torch.int64 and table.shape == (sampling_module.PARAM_ROWS, 2)
    back = Params.from_table(table)
    assert all(torch.equal(getattr(back, f), getattr(params, f)) for f in params.__dataclass_fields__)
