"""The continuous-batching scheduler's decisions: who joins a step, who leaves, how prompts are chunked."""

from __future__ import annotations

import pytest

from raycluster_cli.serve.scheduler import Chunk, Limits, QueueFull, Scheduler

EOS = 99


def _ids(chunks: list[Chunk]) -> list[str]:
    return [c.request_id for c in chunks]


def _run(s: Scheduler, token: int = 7) -> list[Chunk]:
    """Schedule one step and complete it at once, every sampling row getting ``token``."""
    chunks = s.schedule()
    s.complete(chunks, {c.request_id: token for c in chunks if c.samples})
    return chunks


def test_a_request_added_during_a_step_joins_the_next_one() -> None:
    s = Scheduler(Limits(slots=4), frozenset({EOS}))
    s.add("a", [1, 2, 3], 5)
    first = s.schedule()
    assert _ids(first) == ["a"]
    s.add("b", [4, 5], 5)  # arrives while step 1 is in flight
    s.complete(first, {"a": 7})
    second = s.schedule()
    assert _ids(second) == ["a", "b"]
    assert second[0] == Chunk("a", second[0].slot, 3, (7,), True)  # a decodes its first token
    assert second[1].tokens == (4, 5) and second[1].start == 0  # b's whole prompt, same step
    assert second[0].slot != second[1].slot


def test_a_finished_request_leaves_at_once_and_its_slot_is_reused() -> None:
    s = Scheduler(Limits(slots=1), frozenset({EOS}))
    s.add("a", [1], 3)
    s.add("b", [2], 3)
    assert _ids(_run(s)) == ["a"]  # one slot: b waits
    events = s.complete(s.schedule(), {"a": EOS})
    assert events[0].finish_reason == "stop"
    step = s.schedule()
    assert _ids(step) == ["b"] and step[0].start == 0  # b got a's slot in the very next step


def test_max_tokens_and_context_limit_end_a_sequence() -> None:
    s = Scheduler(Limits(slots=2, max_seq=6), frozenset({EOS}))
    s.add("short", [1, 2], 2)
    s.add("long", [1, 2, 3], 3)
    reasons: dict[str, str] = {}
    while s.has_work:
        chunks = s.schedule()
        for e in s.complete(chunks, {c.request_id: 5 for c in chunks if c.samples}):
            if e.finish_reason:
                reasons[e.request_id] = e.finish_reason
    assert reasons == {"short": "length", "long": "length"}
    with pytest.raises(ValueError, match="exceed the context"):
        s.add("too long", [1] * 5, 2)


def test_chunked_prefill_interleaves_with_decodes() -> None:
    s = Scheduler(Limits(slots=4, step_tokens=5, prefill_chunk=4))
    s.add("chat", [1], 50)
    _run(s)  # chat is decoding now
    s.add("long", list(range(10)), 2)
    steps = [s.schedule()]
    for _ in range(3):
        chunks = steps[-1]
        s.complete(chunks, {c.request_id: 7 for c in chunks if c.samples})
        steps.append(s.schedule())
    # every step keeps chat decoding; the long prompt goes in 4-token pieces beside it
    assert [[(c.request_id, len(c.tokens), c.samples) for c in step] for step in steps] == [
        [("chat", 1, True), ("long", 4, False)],
        [("chat", 1, True), ("long", 4, False)],
        [("chat", 1, True), ("long", 2, True)],
        [("chat", 1, True), ("long", 1, True)],
    ]
    assert [c.start for step in steps for c in step if c.request_id == "long"] == [0, 4, 8, 10]


def test_the_token_budget_puts_decodes_first() -> None:
    s = Scheduler(Limits(slots=4, step_tokens=2, prefill_chunk=8))
    for name in ("a", "b"):
        s.add(name, [1], 9)
    _run(s)
    s.add("c", [1, 2, 3], 2)
    assert [(c.request_id, len(c.tokens)) for c in s.schedule()] == [("a", 1), ("b", 1)]


def test_a_busy_sequence_is_not_scheduled_twice_and_finishing_in_flight_frees_later() -> None:
    s = Scheduler(Limits(slots=1))
    s.add("a", [1, 2], 9)
    step = s.schedule()
    assert s.schedule() == []  # a is in flight
    s.finish("a", "stop")  # e.g. the client went away
    assert s.free_slots == []  # its step still writes into the slot
    assert s.complete(step, {"a": 3}) == []
    assert s.free_slots == [0] and not s.has_work


def test_a_full_queue_refuses_but_not_the_health_probe() -> None:
    s = Scheduler(Limits(slots=1, max_waiting=1))
    s.add("a", [1], 1)  # gets the free slot at the next step
    s.add("b", [1], 1)  # waits
    with pytest.raises(QueueFull):
        s.add("c", [1], 1)
    s.add("probe", [1], 1, queue_limit=False)
    assert [q.request_id for q in s.waiting] == ["a", "b", "probe"]


def test_max_rows_splits_the_batch_over_steps_in_flight() -> None:
    s = Scheduler(Limits(slots=4))
    for name in "abcd":
        s.add(name, [1], 9)
    assert s.active == 4
    first, second = s.schedule(max_rows=2), s.schedule(max_rows=2)
    assert _ids(first) == ["a", "b"] and _ids(second) == ["c", "d"]  # two steps, both in flight
    s.complete(first, {"a": 5, "b": 5})
    assert _ids(s.schedule(max_rows=2)) == ["a", "b"]  # a and b go on while c and d are still out


def test_ignore_eos_runs_to_max_tokens_past_the_eos_token() -> None:
    s = Scheduler(Limits(slots=2), frozenset({EOS}))
    s.add("plain", [1], 4)
    s.add("bench", [1], 4, ignore_eos=True)
    seen: dict[str, list[tuple[int | None, str | None]]] = {"plain": [], "bench": []}
    while s.has_work:
        chunks = s.schedule()
        for e in s.complete(chunks, {c.request_id: EOS for c in chunks if c.samples}):
            seen[e.request_id].append((e.token, e.finish_reason))
    assert seen["plain"] == [(EOS, "stop")]
    assert seen["bench"] == [(EOS, None), (EOS, None), (EOS, None), (EOS, "length")]


def test_a_pipeline_holds_slots_for_each_step_in_flight() -> None:
    limits = Limits(slots=16, step_tokens=100, max_seq=256)
    assert limits.for_steps(3) == Limits(slots=48, step_tokens=100, max_seq=256)  # only the slots grow
    assert limits.for_steps(1) == limits
    with pytest.raises(ValueError, match="steps in flight"):
        limits.for_steps(0)


def test_a_prompt_s_chunks_travel_in_consecutive_steps_without_waiting_for_each_other() -> None:
    """Steps go through the stages in the order they were sent, so chunk k + 1 may follow chunk k before it is
    back: a prompt of three chunks is three steps in flight, not three round trips.  Its first token comes from the
    last chunk; it decodes only once that is back, and its slot outlives every step that still carries it."""
    s = Scheduler(Limits(slots=2, prefill_chunk=4, step_tokens=4, max_seq=64), frozenset({EOS}))
    s.add("p", list(range(10, 20)), 3)  # 10 prompt tokens: chunks of 4, 4, 2 (the step's budget)
    steps = [s.schedule(), s.schedule(), s.schedule(), s.schedule()]
    assert [[(c.start, len(c.tokens), c.samples) for c in step] for step in steps] == [
        [(0, 4, False)],
        [(4, 4, False)],
        [(8, 2, True)],
        [],  # nothing more until the last chunk's token is back
    ]
    assert [e.token for e in s.complete(steps[0], {})] == [] and s.running["p"].computed == 4
    s.complete(steps[1], {})
    assert s.schedule() == []  # still travelling: the last chunk
    events = s.complete(steps[2], {"p": 7})
    assert [(e.request_id, e.token) for e in events] == [("p", 7)]
    assert [(c.start, c.tokens) for c in s.schedule()] == [(10, (7,))]  # decodes from the end of the prompt

    s.add("q", list(range(30, 42)), 3)  # 12 tokens: two chunks of three sent, then the client leaves
    first, second = s.schedule(), s.schedule()
    slot = s.running["q"].slot
    s.finish("q", "abort")
    assert s.schedule() == []  # its third chunk never goes
    s.complete(first, {})
    assert "q" in s.running and slot not in s.free_slots  # the second chunk still writes into its slot
    s.complete(second, {})
    assert "q" not in s.running and slot in s.free_slots


def test_a_step_s_token_cap_cuts_the_prompt_chunk_not_the_decodes() -> None:
    s = Scheduler(Limits(slots=4, step_tokens=64, prefill_chunk=32, max_seq=128))
    s.add("a", [1, 2], 8)
    s.complete(s.schedule(), {"a": 5})  # a decodes from now on
    s.add("b", list(range(3, 33)), 4)
    step = s.schedule(max_tokens=10)
    assert [(c.request_id, c.start, len(c.tokens)) for c in step] == [("a", 2, 1), ("b", 0, 9)]
    assert [(c.request_id, c.start, len(c.tokens)) for c in s.schedule()] == [("b", 9, 21)]  # the rest, uncapped


def test_a_prompt_alone_takes_the_whole_step_and_beside_decodes_only_its_chunk() -> None:
    """``prefill_chunk`` protects decoding streams; a step of prompts alone has none to protect, and a product of
    256 rows costs a CPU less a row than four of 64."""
    s = Scheduler(Limits(slots=4, step_tokens=16, prefill_chunk=4, max_seq=64), frozenset({EOS}))
    s.add("long", list(range(40)), 2)
    s.add("next", list(range(9)), 2)
    first = s.schedule()
    assert [(c.request_id, c.start, len(c.tokens)) for c in first] == [("long", 0, 16)]  # first come, whole budget
    s.complete(first, {})
    assert [(c.request_id, c.start, len(c.tokens)) for c in _run(s)] == [("long", 16, 16)]
    assert [(c.request_id, c.start, len(c.tokens), c.samples) for c in _run(s)] == [
        ("long", 32, 8, True), ("next", 0, 8, False),  # the rest of long, then next fills the budget
    ]  # fmt: skip
    # long decodes now: next's last token is capped at prefill_chunk beside it, and so would a longer rest be
    s.add("third", list(range(20)), 2)
    step = s.schedule()
    assert [(c.request_id, len(c.tokens)) for c in step] == [("long", 1), ("next", 1), ("third", 4)]
