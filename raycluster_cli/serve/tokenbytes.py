"""A token's own bytes, for log-probability entries: OpenAI's ``bytes`` and a ``token`` string that is distinct
for every token.

Decoding a token alone loses what only its context gives: a SentencePiece piece "▁Paris" decodes to "Paris", a
byte-level piece of one byte of a four-byte emoji to "�" (so four different tokens share one name and collide
as ``top_logprobs`` keys).  A token's vocabulary entry holds its bytes exactly: a byte-level BPE's through GPT-2's
byte-to-character map, a SentencePiece piece with "▁" for a space and ``<0xNN>`` for a byte-fallback byte.  The
token string is those bytes as UTF-8, a byte that is not a whole character written ``\\xNN`` (as OpenAI does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_chars() -> dict[str, int]:
    """GPT-2's map from the printable character standing for each byte back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The type names in a fast tokenizer's decoder (a Sequence's parts included); empty for a slow one."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.add(str(node.get("type", "")))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return found


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """``id -> bytes`` for this tokenizer: its vocabulary entry's bytes (special tokens: their text; a tokenizer
    whose pieces are not bytes, a word-level one: the token decoded alone)."""
    types = _decoder_types(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    gpt2 = _gpt2_chars() if "ByteLevel" in types else None
    pieces = "Metaspace" in types or "ByteFallback" in types
    cache: dict[int, bytes] = {}

    def of(token: int) -> bytes:
        if token in cache:
            return cache[token]
        piece = tokenizer.convert_ids_to_tokens(token)
        if token in special or not isinstance(piece, str):
            found = str(tokenizer.decode([token])).encode()
        elif gpt2 is not None and all(c in gpt2 for c in piece):
            found = bytes(gpt2[c] for c in piece)
        elif pieces and (byte := _BYTE.fullmatch(piece)):
            found = bytes([int(byte.group(1), 16)])
        elif pieces:
            found = piece.replace("▁", " ").encode()
        else:
            found = str(tokenizer.decode([token])).encode()
        cache[token] = found
        return found

    return of


def token_string(data: bytes) -> str:
    """A token's name from its bytes: its text, any byte that is not part of a whole character as ``\\xNN``."""
    return data.decode("utf-8", errors="backslashreplace")
