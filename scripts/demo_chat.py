"""`make demo`'s last step: the service `raycluster serve --json` reported, called as a user would (the real
`openai` client, the service's own key from the file `serve` made, never the cluster's Ray token).

    python scripts/demo_chat.py SERVE_JSON

Prints where the service answers and how to call it (as `serve` does), then one chat request and its answer.
Exit 0: it answered; 1: it did not (the reason in one line); 2: the document is not `serve --json`'s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# words of the demo checkpoint's vocabulary (raycluster_cli/models/tiny_chat.py): no unknown token in the prompt
PROMPT = "hello please write a story of the sun and the moon"
NEW_TOKENS = 16
DEADLINE_S = 60.0  # the request's whole deadline: a tiny model on three hosts answers in about a second


def read_document(path: str) -> dict[str, Any]:
    """The fields the call needs from `serve --json`'s document; ValueError naming the one missing."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    for name in ("url", "model", "api_key_file"):
        if not doc.get(name):
            raise ValueError(f"{path}: no {name!r} (run raycluster serve --json > {path})")
    return doc


def chat(doc: dict[str, Any]) -> tuple[str, Any, float]:
    """One greedy chat request through the service: the answer's text, its usage and the seconds it took."""
    import openai

    key = Path(doc["api_key_file"]).read_text().strip()
    client = openai.OpenAI(base_url=doc["url"], api_key=key, timeout=DEADLINE_S, max_retries=0)
    began = time.monotonic()
    answer = client.chat.completions.create(
        model=doc["model"],
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    seconds = time.monotonic() - began
    if not answer.choices or answer.choices[0].finish_reason is None:
        raise ValueError(f"an answer without a finished choice: {answer.model_dump_json()[:200]}")
    return answer.choices[0].message.content or "", answer.usage, seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        doc = read_document(argv[0])
    except (OSError, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    from raycluster_cli.render.base import Output
    from raycluster_cli.render.operate import render_serve

    render_serve(Output(json_mode=False), doc)
    import openai

    try:
        text, usage, seconds = chat(doc)
    except (openai.OpenAIError, OSError, ValueError) as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""  # the client's own words are vague
        reason = " ".join(f"{exc}{cause}".split()) or type(exc).__name__
        print(f"demo: the chat request to {doc['url']} failed: {reason}", file=sys.stderr)
        return 1
    print(f"   user: {PROMPT}")
    print(f"   {doc['model']} (random weights: random words): {text.strip()}")
    tokens = f"{usage.completion_tokens} token(s)" if usage is not None else "answered"
    print(f"   {tokens} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
