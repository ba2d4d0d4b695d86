"""The Rust ``DecodeStream`` path of ``TextStream`` gives, piece for piece, the text of the window method it replaces
(two ``tokenizer.decode`` calls per token), with real SentencePiece-like and byte-level tokenizers (no model)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raycluster_cli.serve.text import REPLACEMENT, TextStream

from ..text_tokenizers import byte_level, in_context, sentencepiece_like

PROMPT = "The capital of France is"
OUTPUT = " Paris, a city 🙂 with naïve people"
KINDS = {"sentencepiece": sentencepiece_like(), "byte_level": byte_level()}


def _split(tokenizer: Any, prompt: str, output: str) -> tuple[list[int], list[int]]:
    head = tokenizer.encode(prompt, add_special_tokens=False)
    whole = tokenizer.encode(prompt + output, add_special_tokens=False)
    assert whole[: len(head)] == head
    return head, whole[len(head) :]


def _pieces(stream: TextStream, output: list[int], texts: list[bool] | None = None) -> list[str]:
    pieces = []
    for index, token in enumerate(output):
        stream.push(token, text=texts[index] if texts else True)
        pieces.append(stream.take()[0])
    return [*pieces, stream.take(final=True)[0]]


def _both(tokenizer: Any, prompt: list[int], output: list[int], **options: Any) -> tuple[list[str], list[str]]:
    """(the Rust stream's pieces, the window method's), after checking the first really is the Rust stream."""
    fast = TextStream(tokenizer, prompt=prompt, **options)
    assert fast.rust is not None
    return _pieces(fast, output), _pieces(TextStream(tokenizer, prompt=prompt, rust=False, **options), output)


@pytest.mark.parametrize("kind", KINDS)
def test_the_rust_stream_gives_the_window_methods_pieces_in_context(kind: str) -> None:
    """ " Paris" keeps its leading space after the prompt; 🙂's four byte tokens give one piece, never U+FFFD."""
    tokenizer = KINDS[kind]
    prompt, output = _split(tokenizer, PROMPT, OUTPUT)
    fast, window = _both(tokenizer, prompt, output)
    assert fast == window and "".join(fast) == in_context(tokenizer, prompt, output) == OUTPUT
    assert "".join(fast[:2]).startswith(" Paris") and "🙂" in fast and not any(REPLACEMENT in p for p in fast)


@pytest.mark.parametrize(
    ("options", "want", "rust"),
    [
        ({}, " Paris, a", True),
        ({"skip_special": False, "spaces_between_special": False}, " Paris<s>, a", True),
        ({"skip_special": False}, " Paris <s> , a", False),  # the Rust decoder puts no space around <s>
    ],
)
def test_special_tokens_skipped_or_kept_take_the_rust_stream_only_where_it_gives_the_same_text(
    options: dict[str, bool], want: str, rust: bool
) -> None:
    tokenizer = KINDS["sentencepiece"]
    prompt, output = _split(tokenizer, PROMPT, OUTPUT)
    ids = [output[0], tokenizer.bos_token_id, *output[1:3]]  # " Paris" <s> ", a"
    stream = TextStream(tokenizer, prompt=prompt, **options)
    assert (stream.rust is not None) == rust
    assert "".join(_pieces(stream, ids)) == want


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_string_across_a_split_character_ends_the_text_the_same_way(kind: str) -> None:
    tokenizer = KINDS[kind]
    prompt, output = _split(tokenizer, PROMPT, OUTPUT)
    got = []
    for rust in (True, False):
        stream, text = TextStream(tokenizer, ["🙂 w"], prompt=prompt, rust=rust), ""
        for token in output:
            stream.push(token)
            piece, stopped = stream.take()
            text += piece
            if stopped:
                break
        got.append((text, stopped))
    assert got[0] == got[1] == (" Paris, a city ", True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_rust_stream_sends_exactly_what_follows(kind: str) -> None:
    tokenizer = KINDS[kind]
    prompt, output = _split(tokenizer, PROMPT, OUTPUT)
    for cut in range(1, len(output)):
        first = TextStream(tokenizer, prompt=prompt)
        sent = "".join(_pieces(first, output[:cut])[:-1])  # what went out before the failover
        again = TextStream(tokenizer, prompt=prompt)
        again.resume(output[:cut], len(sent))
        assert again.rust is not None
        assert sent + "".join(_pieces(again, output[cut:])) == OUTPUT, cut


def test_an_eos_left_out_of_the_text_adds_nothing_on_either_path() -> None:
    tokenizer = KINDS["byte_level"]
    prompt, output = _split(tokenizer, PROMPT, OUTPUT)
    ids, texts = [*output, tokenizer.eos_token_id], [True] * len(output) + [False]
    fast = _pieces(TextStream(tokenizer, prompt=prompt), ids, texts)
    assert fast == _pieces(TextStream(tokenizer, prompt=prompt, rust=False), ids, texts) and "".join(fast) == OUTPUT


@pytest.mark.parametrize("rust", [True, False])
def test_a_prompt_cut_inside_a_character_does_not_turn_the_output_into_replacement_characters(rust: bool) -> None:
    """The prompt's last five tokens begin inside the first 🙂 (byte-fallback tokens <0xF0> <0x9F> <0x99> <0x82>): a
    window from there decodes every byte token after it, the output's 🙂 too, as U+FFFD."""
    tokenizer = KINDS["sentencepiece"]
    prompt, output = _split(tokenizer, "The city 🙂🙂", "🙂 with")
    assert tokenizer.convert_ids_to_tokens(prompt[-5]) == "<0x82>"
    assert "".join(_pieces(TextStream(tokenizer, prompt=prompt, rust=rust), output)) == "🙂 with"


def test_a_sequence_the_rust_stream_refuses_goes_on_by_the_window_method() -> None:
    """A stray continuation byte after a whole 🙂, then a word: a byte-fallback decoder turns the whole run of bytes,
    the 🙂 already sent included, into U+FFFD, so the text no longer begins with what was sent and ``DecodeStream``
    raises; the stream goes on as the window method does."""
    tokenizer = KINDS["sentencepiece"]
    prompt, output = _split(tokenizer, PROMPT, " 🙂 with")
    stray = tokenizer.convert_tokens_to_ids("<0x82>")
    ids = [*output[:-1], stray, output[-1]]
    stream = TextStream(tokenizer, prompt=prompt)
    pieces = _pieces(stream, ids)
    assert stream.rust is None  # it refused, and was dropped
    assert pieces == _pieces(TextStream(tokenizer, prompt=prompt, rust=False), ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(KINDS)),
    prompt=st.lists(st.integers(0, 299), max_size=8),
    output=st.lists(st.integers(0, 299), min_size=1, max_size=24),
    keep_special=st.booleans(),
)
def test_any_token_sequence_gives_the_same_pieces_on_both_paths(
    kind: str, prompt: list[int], output: list[int], keep_special: bool
) -> None:
    """Random ids, special tokens and stray bytes included (whatever a sampled model may give)."""
    tokenizer = KINDS[kind]
    prompt, output = [t % len(tokenizer) for t in prompt], [t % len(tokenizer) for t in output]
    options = {"skip_special": not keep_special, "spaces_between_special": False}
    fast = _pieces(TextStream(tokenizer, prompt=prompt, **options), output)
    assert fast == _pieces(TextStream(tokenizer, prompt=prompt, rust=False, **options), output)
