"""The scheduler's KV budget in tokens: admission by blocks, growth, preemption by recompute, refusals.

A step is run here by a small model of the stages' cache: each slot holds the tokens written at their positions,
and a sampled token is a function of every token the row's slot holds before it, so a sequence whose cache missed
or misplaced a token (a preemption prefilling the wrong tokens) samples other tokens than when run alone.
"""

from __future__ import annotations

import pytest

from raycluster_cli.serve.scheduler import Chunk, Limits, Scheduler

BLOCK = 4


def _next(held: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(held)) * 31 + len(held)) % 50 + 1


class Cache:
    """What the stages hold: each slot's tokens by position, emptied when a sequence begins at position 0."""

    def __init__(self, slots: int) -> None:
        self.slots: list[list[int]] = [[] for _ in range(slots)]

    def step(self, s: Scheduler, chunks: list[Chunk]) -> dict[str, list[int]]:
        tokens: dict[str, int] = {}
        for c in chunks:
            held = self.slots[c.slot] = [] if c.start == 0 else self.slots[c.slot]
            assert len(held) == c.start, f"{c.request_id} writes at {c.start} after {len(held)} tokens"
            held.extend(c.tokens)
            if c.samples:
                tokens[c.request_id] = _next(held)
        out: dict[str, list[int]] = {}
        for event in s.complete(chunks, tokens):
            if event.token is not None:
                out.setdefault(event.request_id, []).append(event.token)
        return out


def _drain(s: Scheduler, cache: Cache) -> tuple[dict[str, list[int]], int]:
    """Run steps until every sequence ends: what each client was sent, the most sequences running at once."""
    sent: dict[str, list[int]] = {}
    most = 0
    while s.has_work:
        chunks = s.schedule()
        most = max(most, len(s.running))
        for rid, toks in cache.step(s, chunks).items():
            sent.setdefault(rid, []).extend(toks)
    return sent, most


def _limits(**kw: int) -> Limits:
    return Limits(**{"slots": 16, "max_seq": 64, "prefill_chunk": 8, "kv_block": BLOCK, **kw})


def test_a_budget_of_blocks_admits_more_short_requests_than_slots_at_max_seq_would() -> None:
    """64 tokens of budget is one sequence at max_seq (64): by blocks it runs four of 10 tokens at once."""
    s = Scheduler(_limits(kv_tokens=64))
    for i in range(4):
        s.add(f"r{i}", [1, 2, 3, 4, 5, 6], 4)
    s.schedule()
    assert len(s.running) == 4 and s.kv_used_tokens == 4 * 8  # each holds its prompt's two blocks


def test_a_long_request_waits_for_blocks_and_those_behind_it_wait_too() -> None:
    s = Scheduler(_limits(kv_tokens=32))
    s.add("short", [1] * 10, 2)
    s.add("long", [2] * 24, 4)  # 6 blocks: only 5 are left
    s.add("after", [3] * 2, 2)
    cache = Cache(16)
    first = cache.step(s, s.schedule())
    assert list(s.running) == ["short"] and [q.request_id for q in s.waiting] == ["long", "after"]
    sent, _ = _drain(s, cache)
    counts = {k: len(first.get(k, [])) + len(sent.get(k, [])) for k in first | sent}
    assert counts == {"short": 2, "long": 4, "after": 2}


def test_a_request_that_can_never_fit_is_refused_naming_max_tokens() -> None:
    s = Scheduler(_limits(kv_tokens=32))
    with pytest.raises(ValueError, match="exceed the KV cache budget of 32 tokens: ask for fewer max_tokens"):
        s.add("big", [1] * 20, 13)
    with pytest.raises(ValueError, match="exceed the context of 64"):
        Scheduler(_limits(kv_tokens=256)).add("big", [1] * 60, 5)
    s.add("fits", [1] * 20, 12)  # exactly the budget


def test_running_out_of_blocks_preempts_the_latest_by_recompute_and_its_tokens_are_unchanged() -> None:
    """Three sequences that each grow to 24 tokens in a budget of 40: the latest admitted is preempted (its
    blocks go back, it is prefilled again with what it generated) and ends with the tokens it makes alone; every
    client is sent each of its tokens once."""
    prompts = {"a": [5, 1, 4], "b": [2, 7, 1, 8], "c": [3, 3]}
    alone = {}
    for rid, prompt in prompts.items():
        solo = Scheduler(_limits())
        solo.add(rid, prompt, 20)
        alone[rid] = _drain(solo, Cache(16))[0][rid]
    s = Scheduler(_limits(kv_tokens=40))
    for rid, prompt in prompts.items():
        s.add(rid, prompt, 20)
    sent, most = _drain(s, Cache(16))
    assert s.preemptions >= 1 and most == 3
    assert sent == alone  # each token once, in order, the same as alone
    assert s.free_blocks == 10 and s.kv_used_tokens == 0


def test_a_preempted_sequence_gives_its_slot_back_for_the_stages_to_free() -> None:
    s = Scheduler(_limits(kv_tokens=16, slots=2))
    s.add("a", [1] * 6, 6)
    s.add("b", [2] * 6, 6)
    cache, sent = Cache(2), []
    for _ in range(3):  # the prompts (4 blocks: none left), then decodes at positions 6 and 7
        sent += cache.step(s, s.schedule()).get("b", [])
    assert s.free_blocks == 0 and s.take_released() == []
    chunks = s.schedule()  # position 8 needs a third block each: a takes b's, b is preempted
    assert [c.request_id for c in chunks] == ["a"] and s.preemptions == 1
    assert s.take_released() == [(1, 1)] and [q.request_id for q in s.waiting] == ["b"]
    b = s.waiting[0]
    assert b.prompt == [2] * 6 + sent and len(sent) == 3 and b.max_new_tokens == 3 and b.blocks == 0
