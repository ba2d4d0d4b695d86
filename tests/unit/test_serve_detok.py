"""The text of generated tokens in context, with real SentencePiece-like and byte-level tokenizers (no model)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from raycluster_cli.serve.text import REPLACEMENT, TextStream

from ..text_tokenizers import byte_level, sentencepiece_like

PROMPT = "The capital of France is"
OUTPUT = " Paris, a city 🙂 with naïve people"


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return sentencepiece_like() if request.param == "sentencepiece" else byte_level()


def _split(tokenizer: Any) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    whole = tokenizer.encode(PROMPT + OUTPUT, add_special_tokens=False)
    assert whole[: len(prompt)] == prompt
    return prompt, whole[len(prompt) :]


def _pieces(stream: TextStream, output: list[int]) -> list[str]:
    pieces = []
    for token in output:
        stream.push(token)
        pieces.append(stream.take()[0])
    return [*pieces, stream.take(final=True)[0]]


def test_the_first_token_keeps_its_leading_space_and_no_piece_splits_a_character(tokenizer: Any) -> None:
    prompt, output = _split(tokenizer)
    pieces = _pieces(TextStream(tokenizer, prompt=prompt), output)
    in_context = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
    assert in_context == OUTPUT  # what transformers gives after the prompt: " Paris", not "Paris"
    assert "".join(pieces) == in_context
    assert pieces[0] == " Paris" or "".join(pieces[:2]).startswith(" Paris")
    assert not any(REPLACEMENT in p for p in pieces)  # 🙂 is four byte tokens in both tokenizers
    assert len(output) > len(OUTPUT.split()) + 3


def test_special_tokens_are_skipped_or_kept_with_or_without_spaces() -> None:
    tokenizer = sentencepiece_like()
    prompt, output = _split(tokenizer)
    bos = tokenizer.bos_token_id
    ids = [output[0], bos, *output[1:3]]  # " Paris" <s> ", a"

    def text(**options: bool) -> str:
        return "".join(_pieces(TextStream(tokenizer, prompt=prompt, **options), ids))

    assert text() == " Paris, a"
    assert text(skip_special=False, spaces_between_special=False) == " Paris<s>, a"
    assert text(skip_special=False) == " Paris <s> , a"


@pytest.mark.parametrize(("include", "want"), [(False, " Paris, a"), (True, " Paris, a city")])
def test_the_stop_string_is_in_the_text_only_when_asked(include: bool, want: str) -> None:
    tokenizer = sentencepiece_like()
    prompt, output = _split(tokenizer)
    stream = TextStream(tokenizer, [" city"], prompt=prompt, include_stop_str=include)
    pieces = []
    for token in output:
        stream.push(token)
        piece, stopped = stream.take()
        pieces.append(piece)
        if stopped:
            break
    assert stopped and "".join(pieces) == want


def test_logprob_entries_name_each_token_by_its_own_bytes_without_collisions(tokenizer: Any) -> None:
    from raycluster_cli.serve.protocol import Logprobs
    from raycluster_cli.serve.text import TokenLogprob
    from raycluster_cli.serve.tokenbytes import token_bytes

    _, output = _split(tokenizer)
    scored = Logprobs(token_bytes(tokenizer), chat=True)
    emoji = tokenizer.encode(" 🙂", add_special_tokens=False)
    scored.add([TokenLogprob(t, -1.0, tuple((e, -2.0) for e in emoji)) for t in output])
    entries = scored.take()["content"]  # type: ignore[index]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == OUTPUT  # every byte, " Paris" with its space
    assert entries[0]["token"].startswith(" Pa")  # its leading space kept
    names = {e["token"] for e in entries[0]["top_logprobs"]}
    assert len(names) == len(set(emoji)) >= 4 and REPLACEMENT not in "".join(names)  # 🙂's byte tokens, distinct
    completion = Logprobs(token_bytes(tokenizer), chat=False)
    completion.add([TokenLogprob(t, -1.0) for t in output])
    taken = completion.take()
    assert taken is not None and len(set(taken["tokens"])) == len(set(output))
    starts = [OUTPUT[:o].encode() for o in taken["text_offset"]]
    assert all(OUTPUT.encode().startswith(s) for s in starts) and taken["text_offset"][0] == 0
