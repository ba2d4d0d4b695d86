"""Sampling, incremental detokenization and stop strings, with real tokenizers (no model, no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from raycluster_cli.serve.text import REPLACEMENT, Sampling, TextStream, sample  # noqa: E402

TEXT = "naïve café — 日本語のテキスト, emoji 🙂🙂 and plain words"


@pytest.fixture(scope="module")
def byte_level() -> Any:
    """A byte-level BPE small enough that many-byte characters are split across tokens."""
    core = tokenizers.Tokenizer(tokenizers.models.BPE())
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(["plain words and more plain words"] * 5, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core)


def test_streamed_pieces_never_split_a_character(byte_level: Any) -> None:
    ids = byte_level.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # some characters really are split over tokens
    stream, pieces = TextStream(byte_level), []
    for token in ids:
        stream.push(token)
        pieces.append(stream.take()[0])
    pieces.append(stream.take(final=True)[0])
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == byte_level.decode(ids) == TEXT


def test_a_stop_string_across_tokens_ends_the_text_before_it(byte_level: Any) -> None:
    stream, pieces, stopped_at = TextStream(byte_level, stop=["テキ", "zzz"]), [], None
    for index, token in enumerate(byte_level.encode(TEXT)):
        stream.push(token)
        piece, stopped = stream.take()
        pieces.append(piece)
        if stopped:
            stopped_at = index
            break
    assert stopped_at is not None
    assert "".join(pieces) == "naïve café — 日本語の"


def test_held_back_text_is_released_at_the_end(byte_level: Any) -> None:
    stream = TextStream(byte_level, stop=["words!"])
    for token in byte_level.encode("plain words"):
        stream.push(token)
    held, _ = stream.take()
    rest, stopped = stream.take(final=True)
    assert held + rest == "plain words" and not stopped and rest  # "words" could have begun "words!"


def test_greedy_and_seeded_sampling() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert sample(logits, Sampling(temperature=0), None) == 1
    seeded = Sampling(temperature=1.0, seed=42)
    draws = [[sample(logits, seeded, gen) for _ in range(20)] for gen in (seeded.generator(), seeded.generator())]
    assert draws[0] == draws[1] and set(draws[0]) > {1}  # same seed, same tokens; really sampled
    nucleus = Sampling(temperature=1.0, top_p=0.3, seed=1)
    gen = nucleus.generator()
    assert {sample(logits, nucleus, gen) for _ in range(20)} == {1}  # only the top token is within top_p
