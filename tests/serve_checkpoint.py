"""A tiny random Llama with a real tokenizer and chat template, written offline by the test itself.

The tokenizer is a ``tokenizers`` WordLevel model over a fixed word list (split on whitespace, joined
with spaces when decoded) wrapped in ``transformers.PreTrainedTokenizerFast``; the model is a random
``LlamaForCausalLM``.  Both are saved with ``save_pretrained`` into one folder, as a real checkpoint is.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers

from .llama_checkpoint import write_llama

SPECIALS = ["[UNK]", "[PAD]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
_WORD_LIST = (
    "the a an of to in on at for with by from and or but not is are was were be been cat dog bird fish "
    "tree river hill road town city house door window light dark red green blue small large old new fast "
    "slow one two three four five six seven eight nine ten run walk sing jump read write see hear say "
    "think hello world yes no maybe please thanks story time day night sun moon star sky rain snow wind "
    "fire stone"
)
WORDS = _WORD_LIST.split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_chat_llama(path: Path, *, seed: int = 0, **sizes: int) -> Path:
    """Tokenizer + random Llama in ``path``; the vocabulary is the specials then the words.  ``sizes``
    override the Llama's (hidden_size, num_hidden_layers, …: a larger model for a benchmark)."""
    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    core = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[4:],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    settings = {
        "vocab_size": len(vocab),
        "max_position_embeddings": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
        "pad_token_id": vocab["[PAD]"],
    }
    write_llama(path, seed=seed, **(settings | sizes))
    tokenizer.save_pretrained(str(path))
    return path


def poison_embedding(path: Path, token: int) -> Path:
    """Set the embedding row of ``token`` to NaN in the checkpoint at ``path`` (a real checkpoint whose weights
    turn one token's logits into NaN, as an overflowing half-precision model's do)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    tensors[name][token] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert torch.isnan(load_file(str(weights))[name][token]).all()
    return path
