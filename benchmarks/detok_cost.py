"""What incremental detokenization costs the engine's loop per token: `TextStream`'s window method (two
``tokenizer.decode`` calls per token) against the same stream kept by ``tokenizers``' ``DecodeStream``.

Usage:  PYTHONPATH=. python benchmarks/detok_cost.py [--tokens 4000] [--repeats 7] [--out FILE]

No real tokenizer is on this machine, so the two kinds open models ship are trained here, at real vocabulary
sizes, on the READMEs of the installed Python packages (their METADATA files: English prose, code, tables) and
the standard library's top-level modules:
a GPT-2-like byte-level BPE of 50,257 tokens, and a Llama-2-like BPE of 32,000 over "▁"-prefixed pieces with
byte fallback (one ``<0xNN>`` token per byte of a character outside the vocabulary) and a Metaspace decoder.
The streamed text is held out of training: every 7th README, with a multilingual paragraph (accents, CJK,
emoji: characters split over several tokens) every 40 lines, cut to ``--tokens`` tokens after a prompt of 32 tokens (or the
few more that end its last character).

For each tokenizer and method: a fresh stream, every token pushed and taken (what the engine does per token),
CPU seconds (``time.process_time``) over all tokens, ``--repeats`` times; median, min and max µs per token.
Checks that both methods give the same text, equal to ``decode(prompt + output)`` minus ``decode(prompt)``.
Prints one JSON document (also to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from raycluster_cli.serve.text import TextStream

MULTILINGUAL = "naïve café — 日本語のテキスト, Ελληνικά, emoji 🙂🚀👩‍💻 and déjà vu: ½ ≈ 0.5 °C"


def corpus() -> tuple[list[str], str]:
    """(training texts, held-out text to stream): the installed packages' READMEs."""
    site = Path(transformers.__file__).resolve().parent.parent
    files = sorted(site.glob("*.dist-info/METADATA"))
    texts = [f.read_text(errors="replace") for f in files]
    held = [t for i, t in enumerate(texts) if i % 7 == 3]
    lines = "\n".join(held).splitlines()
    mixed = [line if i % 40 else f"{line} {MULTILINGUAL}" for i, line in enumerate(lines)]
    stdlib = sorted(Path(json.__file__).resolve().parent.parent.glob("*.py"))  # more text to reach the vocabularies
    train = [t for i, t in enumerate(texts) if i % 7 != 3] + [f.read_text(errors="replace") for f in stdlib]
    return train, "\n".join(mixed)


def byte_level(train: list[str]) -> Any:
    core = tokenizers.Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=50257, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    core.train_from_iterator(train, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def metaspace(train: list[str]) -> Any:
    """Trained as a plain BPE over Metaspace pieces, then rebuilt with the 256 byte tokens and byte fallback."""
    specials = ["<unk>", "<s>", "</s>"]
    core = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=32000 - 256, special_tokens=specials, limit_alphabet=200)
    core.train_from_iterator(train, trainer)
    trained = json.loads(core.to_str())["model"]  # (merges.txt cannot hold pieces with a newline)
    vocab, merges = (
        trained["vocab"],
        [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]],
    )
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    rebuilt = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    rebuilt.add_special_tokens(specials)
    rebuilt.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rebuilt.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=rebuilt,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def run(tokenizer: Any, prompt: list[int], output: list[int], rust: bool) -> tuple[float, str]:
    """CPU µs per token of one stream over ``output``, and its text."""
    stream, text = TextStream(tokenizer, prompt=prompt, rust=rust), []
    if rust and stream.rust is None:
        raise SystemExit("no DecodeStream for this tokenizer")
    began = time.process_time()
    for token in output:
        stream.push(token)
        text.append(stream.take()[0])
    text.append(stream.take(final=True)[0])
    return (time.process_time() - began) / len(output) * 1e6, "".join(text)


def measure(name: str, tokenizer: Any, text: str, tokens: int, repeats: int) -> dict[str, Any]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = next(n for n in range(32, len(ids)) if not tokenizer.decode(ids[:n]).endswith("\ufffd"))  # whole characters
    prompt, output = ids[:cut], ids[cut : cut + tokens]
    ids = prompt + output
    want = tokenizer.decode(ids)[len(tokenizer.decode(prompt)) :]
    split = sum(1 for t in output if "\ufffd" in tokenizer.decode([t]))  # tokens that are part of a character
    row: dict[str, Any] = {"tokenizer": name, "vocab": len(tokenizer), "tokens": len(output), "split": split}
    row["chars_per_token"] = round(len(want) / len(output), 2)
    for method, rust in (("window", False), ("decode_stream", True)):
        runs = [run(tokenizer, prompt, output, rust) for _ in range(repeats)]
        if any(got != want for _, got in runs):
            raise SystemExit(f"{name} {method}: the text differs from decode(prompt + output) - decode(prompt)")
        us = sorted(cost for cost, _ in runs)
        row[method] = {
            "median_us": round(statistics.median(us), 2),
            "min_us": round(us[0], 2),
            "max_us": round(us[-1], 2),
        }
    row["speedup"] = round(row["window"]["median_us"] / row["decode_stream"]["median_us"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    train, text = corpus()
    rows = []
    for name, build in (("byte-level BPE (GPT-2-like)", byte_level), ("Metaspace BPE + byte fallback", metaspace)):
        began = time.monotonic()
        tokenizer = build(train)
        print(f"{name}: trained in {time.monotonic() - began:.0f} s", file=sys.stderr)
        rows.append(measure(name, tokenizer, text, args.tokens, args.repeats))
    report = {
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
