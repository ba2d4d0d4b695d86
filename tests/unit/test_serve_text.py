"""Sampling, incremental detokenization and stop strings, with real tokenizers (no model, no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from raycluster_cli.serve.text import REPLACEMENT, Sampling, TextStream, adjust  # noqa: E402

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


def _hf(processor: Any, prompt: list[int], output: list[int], logits: Any) -> Any:
    """What a transformers logits processor makes of one row, given the sequence so far."""
    return processor(torch.tensor([prompt + output]), logits.clone().unsqueeze(0))[0]


def test_logit_changes_equal_transformers_own_processors() -> None:
    """``repetition_penalty``, a one-token ``logit_bias`` and ``min_tokens`` give, row for row, what transformers'
    ``RepetitionPenaltyLogitsProcessor``, ``SequenceBiasLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
    give (the processors ``generate`` runs for ``repetition_penalty``, ``sequence_bias``, ``min_new_tokens``)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=gen) * 3
    prompt, output = [4, 9, 9, 17], [17, 30, 2]
    hf = transformers.generation.logits_process
    penalized = adjust(logits, Sampling(temperature=0, repetition_penalty=1.7), prompt, output, frozenset({49}))
    assert torch.equal(penalized, _hf(hf.RepetitionPenaltyLogitsProcessor(1.7), prompt, output, logits))
    assert not torch.equal(penalized, logits)
    biased = adjust(logits, Sampling(logit_bias=((9, 5.0), (44, -3.5))), prompt, output, frozenset({49}))
    want = _hf(hf.SequenceBiasLogitsProcessor({(9,): 5.0, (44,): -3.5}), prompt, output, logits)
    assert torch.allclose(biased, want)
    for generated, blocked in (([], True), ([5, 6], True), ([5, 6, 7], False)):
        held = adjust(logits, Sampling(min_tokens=3), prompt, generated, frozenset({49, 0}))
        want = _hf(hf.MinNewTokensLengthLogitsProcessor(len(prompt), 3, [49, 0]), prompt, generated, logits)
        assert torch.equal(held, want) and bool(torch.isinf(held[49])) == blocked
    assert torch.equal(adjust(logits, Sampling(min_tokens=3, ignore_eos=True), prompt, [], frozenset({49})), logits)
    assert adjust(logits, Sampling(), prompt, output, frozenset({49})) is logits  # nothing asked: no copy


def test_frequency_and_presence_penalties_follow_openais_formula() -> None:
    """logit − frequency × (times generated) − presence × (generated at all), over the output only."""
    logits = torch.zeros(6)
    sampling = Sampling(frequency_penalty=0.5, presence_penalty=1.25)
    got = adjust(logits, sampling, [1, 1, 1], [2, 3, 3, 3], frozenset())
    assert got.tolist() == [0.0, 0.0, -1.75, -2.75, 0.0, 0.0]  # the prompt's token 1 is not penalized
    negative = adjust(logits, Sampling(presence_penalty=-2.0), [], [5], frozenset())
    assert negative.tolist() == [0.0] * 5 + [2.0]  # a negative penalty favours what was said
