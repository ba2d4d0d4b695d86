"""Issue 49's E4: a long prompt arriving beside decoding streams, against the same prompt alone, on any
OpenAI-compatible service (raycluster's, vLLM's), through the real ``openai`` client.

Usage:  PYTHONPATH=. python benchmarks/prefill_beside_decodes.py --url http://HOST:PORT/v1 --api-key-file F
            [--model NAME] [--prompt-tokens 1024] [--streams 16] [--rounds 5] [--out FILE]

1. The long prompt's time to first token alone (``--rounds`` times, one at a time; ``max_tokens`` 1, streamed).
2. ``--streams`` streams of short prompts decoding long answers (``ignore_eos``): their time per output token is
   taken over a window without the long prompt, then the long prompt is sent beside them (``--rounds`` times, one
   after the other), and each stream's token gaps while it prefills (from its send to its first token) are its
   time per output token beside the prefill.
Prints one JSON document: p50 (and every round's) TTFT alone and beside, their ratio (target <= 2), the streams'
TPOT p50 without and while prefilling, their ratio (target <= 1.5).  The prompt is words of the bench's list,
sized to ``--prompt-tokens`` by the service's own count (``usage.prompt_tokens`` of a probe), each round's
different (a prefix cache cannot serve it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Any

import openai
from _report import emit  # benchmarks/_report.py, beside this script

from raycluster_cli.verbs.serve_load import WORDS


def _words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def _tokens_per_word(client: openai.AsyncOpenAI, model: str) -> float:
    probe = await client.completions.create(model=model, prompt=_words(200, 1), max_tokens=1)
    assert probe.usage is not None
    return probe.usage.prompt_tokens / 200


async def _ttft(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[float, float]:
    """(seconds to the first token, when it was sent by the monotonic clock)."""
    sent = time.monotonic()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=1, stream=True)
    async for _ in stream:
        return time.monotonic() - sent, sent
    raise RuntimeError("the stream ended without a token")


async def _decoder(
    client: openai.AsyncOpenAI, model: str, seed: int, tokens: int, stop: asyncio.Event, times: list[float]
) -> None:
    """One stream decoding ``tokens`` tokens (again and again until ``stop``), every chunk's arrival in ``times``."""
    while not stop.is_set():
        stream = await client.completions.create(
            model=model,
            prompt=_words(8, seed),
            max_tokens=tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            times.append(time.monotonic())
            if stop.is_set():
                await stream.close()
                return


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    """The gaps between consecutive arrivals that both fall within [start, end]."""
    inside = [t for t in times if start <= t <= end]
    return [b - a for a, b in itertools.pairwise(inside)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    key = args.api_key_file.read_text().strip() if args.api_key_file else "unused"
    client = openai.AsyncOpenAI(base_url=args.url, api_key=key, max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    words = int(args.prompt_tokens / await _tokens_per_word(client, model))
    prompts = [_words(words, 100 + i) for i in range(2 * args.rounds + 1)]
    await _ttft(client, model, prompts[-1])  # warm-up
    alone = [(await _ttft(client, model, prompts[i]))[0] for i in range(args.rounds)]
    stop = asyncio.Event()
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    decoders = [
        asyncio.create_task(_decoder(client, model, 7 + i, args.stream_tokens, stop, arrivals[i]))
        for i in range(args.streams)
    ]
    await asyncio.sleep(args.settle_s)  # every stream admitted and decoding
    quiet_from = time.monotonic()
    await asyncio.sleep(args.window_s)
    quiet = [g for times in arrivals for g in _gaps(times, quiet_from, time.monotonic())]
    beside, during = [], []
    for i in range(args.rounds):
        ttft, sent = await _ttft(client, model, prompts[args.rounds + i])
        beside.append(ttft)
        during += [g for times in arrivals for g in _gaps(times, sent, sent + ttft)]
        await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*decoders, return_exceptions=True)
    p50 = statistics.median
    report = {
        "url": args.url,
        "model": model,
        "prompt_tokens": args.prompt_tokens,
        "prompt_words": words,
        "streams": args.streams,
        "ttft_alone_s": [round(t, 3) for t in alone],
        "ttft_beside_s": [round(t, 3) for t in beside],
        "ttft_beside_over_alone_p50": round(p50(beside) / p50(alone), 2),
        "tpot_without_ms_p50": round(p50(quiet) * 1000, 1) if quiet else None,
        "tpot_while_prefilling_ms_p50": round(p50(during) * 1000, 1) if during else None,
        "gaps_counted": {"without": len(quiet), "while_prefilling": len(during)},
    }
    if quiet and during:
        report["tpot_while_over_without_p50"] = round(p50(during) / p50(quiet), 2)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--api-key-file", type=Path)
    p.add_argument("--model", default="")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settle-s", type=float, default=20.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = asyncio.run(run(args))
    emit(report, args.out)


if __name__ == "__main__":
    main()
