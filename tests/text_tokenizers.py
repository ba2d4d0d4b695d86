"""Real ``transformers`` tokenizers of the two kinds open models ship, built offline by the tests themselves.

``sentencepiece_like``: a Unigram model over "▁"-prefixed pieces with byte fallback, a Metaspace pre-tokenizer
and decoder (prepend scheme "first"), as Llama-2's and Mistral's are: the decoder drops the space of a sequence's
first piece, and a character missing from the vocabulary becomes its UTF-8 bytes, one ``<0xNN>`` token each.
``byte_level``: a GPT-2-like byte-level BPE small enough that many-byte characters are split across tokens.
"""

from __future__ import annotations

from typing import Any

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers

SENTENCE = "The capital of France is Paris, a city with many people"


def sentencepiece_like() -> Any:
    words = SENTENCE.replace(",", " ,").split()
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces += [("▁" + w, -1.0) for w in words] + [("▁", -5.0), (",", -2.0)]
    pieces += [(c, -8.0) for c in sorted(set("".join(words)) - {","})]
    core = tokenizers.Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def byte_level() -> Any:
    core = tokenizers.Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    core.train_from_iterator([SENTENCE, "plain words and more plain words"] * 5, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def in_context(tokenizer: Any, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``, as ``transformers`` decodes them together (what a service streams)."""
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    return str(tokenizer.decode([*prompt, *new], skip_special_tokens=True)[len(before) :])
