"""A tiny random Llama with a real tokenizer and chat template, written on this machine: what `make demo` serves
(no download, no model a lab host lacks), and the checkpoint the serve tests check against ``transformers``.

The tokenizer is a ``tokenizers`` WordLevel model over a fixed word list (split on whitespace, joined with spaces
when decoded) wrapped in ``transformers.PreTrainedTokenizerFast``; the model is a random ``LlamaForCausalLM``.
Both are saved with ``save_pretrained`` into one folder, as a real checkpoint is. torch, transformers and
tokenizers are imported inside the functions: nothing loads them until a checkpoint is written.

``python -m raycluster_cli.models.tiny_chat DIR`` writes one (the demo's step).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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
# Llama's block shape at a few thousand parameters a block: 3 blocks, one per lab host
TINY = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def randomize(model: Any, seed: int) -> None:
    """Draw ``model``'s weights wide enough that greedy tokens vary (a freshly initialised model's barely do):
    norms near 1, embeddings at 0.5, every other matrix at 0.15, from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_((0.5 if "embed" in name else 0.15) * torch.randn(param.shape, generator=gen))


def chat_tokenizer() -> Any:
    """The word-level tokenizer with its specials (``SPECIALS`` then ``WORDS``) and chat template."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    core = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return fast_tokenizer(core, unk_token="[UNK]")


def fast_tokenizer(core: Any, unk_token: str | None) -> Any:
    """``core`` (a ``tokenizers.Tokenizer`` holding ``SPECIALS``) as a ``transformers`` tokenizer with the
    specials' roles and the chat template, no clean-up of spaces."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=unk_token,
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[4:],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_chat_llama(path: Path, *, seed: int = 0, **sizes: Any) -> Path:
    """Tokenizer + random Llama in ``path``; the vocabulary is the specials then the words. ``sizes`` override the
    Llama's config (``TINY``'s hidden_size, num_hidden_layers, …: a larger model for a benchmark)."""
    import torch
    import transformers

    ids = {token: index for index, token in enumerate(SPECIALS)}
    settings = TINY | {
        "vocab_size": len(SPECIALS) + len(WORDS),
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["[PAD]"],
    }
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(settings | sizes))).eval()
    randomize(model, seed)
    model.save_pretrained(str(path))
    chat_tokenizer().save_pretrained(str(path))
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m raycluster_cli.models.tiny_chat DIR", file=sys.stderr)
        return 2
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line for the demo's step, not a bar per shard
    path = write_chat_llama(Path(argv[0]))
    files = sorted(p for p in path.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"   {path}: a random Llama ({TINY['num_hidden_layers']} blocks, {size / 1e6:.1f} MB, {len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
