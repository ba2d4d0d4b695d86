"""From sampled token ids to the text a client sees: a request's sampling settings and the processors that change
its logits (the draw itself is ``models.sampling``'s), incremental detokenization, stop strings.

Detokenizing one token at a time is wrong for byte-level tokenizers: a character of several bytes
can be split across tokens, and decoding the first alone gives U+FFFD.  As vLLM and TGI do, the
stream decodes a short window of recent tokens twice (with and without the newest) and emits the
difference only once it does not end in a replacement character.  Stop strings may straddle tokens,
so text that could still become the start of a stop string is held back until it cannot.  Where the
tokenizer is a ``tokenizers`` one whose ``decode`` adds nothing of its own, the same window is kept by the
library's own ``DecodeStream`` (in Rust, as vLLM's fast detokenizer): the same text for a fraction of the
CPU on the loop that drives every pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class Sampling:
    """How to pick the next token: temperature 0 is greedy (argmax, as ``generate(do_sample=False)``).

    Besides OpenAI's ``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``,
    the extensions vLLM and llama.cpp's server take under the same names and meanings: ``top_k``, ``min_p``,
    ``repetition_penalty`` and ``min_tokens``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # the sequence ends only at its token limit (a benchmark's fixed lengths)
    # None: no log-probabilities; k: each generated token's, and the k most likely tokens' at its position
    logprobs: int | None = None
    prompt_logprobs: bool = False  # also each prompt token's (after the first), with the same k best
    top_k: int = 0  # sample among the k most likely tokens only; 0: all
    min_p: float = 0.0  # drop the tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0  # subtracted once for every time a token was generated
    # a logit of a token in the prompt or the output so far divided by it (multiplied when negative)
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS cannot end the output before this many tokens
    # how the tokens become text (vLLM's names and defaults; TextStream)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string (or the EOS's text) ends the text

    @property
    def adjusts_logits(self) -> bool:
        """Does this request change the model's logits before it picks (a bias, a penalty, a minimum)?"""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def adjust(
    logits: torch.Tensor, sampling: Sampling, prompt: Sequence[int], output: Sequence[int], eos: frozenset[int]
) -> torch.Tensor:
    """One row's logits [vocab] as the request's own processors leave them, in vLLM's order: ``logit_bias`` and
    ``min_tokens`` (EOS impossible while the output is shorter), then the repetition penalty (over the prompt's and
    the output's tokens, as ``transformers``' ``repetition_penalty``), then the frequency and presence penalties
    (over the output's, OpenAI's formula: ``logit - frequency * count - presence * (count > 0)``).

    ``output`` is every token generated so far, those sent before a failover included, so a resumed stream is
    penalized as it would have been where it began.  The model's own logits are not changed (log-probabilities
    are the model's)."""
    if not sampling.adjusts_logits:
        return logits
    logits = logits.float().clone()
    if sampling.logit_bias:
        ids = torch.tensor([token for token, _ in sampling.logit_bias])
        logits.index_add_(0, ids, torch.tensor([bias for _, bias in sampling.logit_bias]))
    if len(output) < sampling.min_tokens and eos and not sampling.ignore_eos:
        logits[torch.tensor(sorted(eos))] = float("-inf")
    if sampling.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)))
        scores = logits[seen]
        penalty = sampling.repetition_penalty
        logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if (sampling.frequency_penalty or sampling.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output)), minlength=logits.numel())[: logits.numel()].float()
        logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    return logits


def out_of_vocab(ids: Sequence[int], vocab: int) -> int | None:
    """The first id that is not a row of the model's embedding (0..vocab - 1), None when every one is."""
    return next((t for t in ids if not 0 <= t < vocab), None)


def bad_logits(logits: torch.Tensor) -> str | None:
    """Why a row's logits cannot be sampled from (a NaN or +inf: softmax and multinomial fail, argmax picks
    garbage), None when they can.  One reduction first (a sum is finite iff every value is); -inf alone is a
    token made impossible, not an error."""
    if bool(torch.isfinite(logits.float().sum())):
        return None
    if bool(torch.isnan(logits).any()):
        return "NaN"
    return "+inf" if bool(torch.isposinf(logits).any()) else None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the ``top`` most likely tokens' at its position ((id, logprob),
    most likely first), from the model's own distribution: the logits' log-softmax before temperature and top-p
    (what vLLM returns by default), so they are the same whatever the request's sampling settings."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under one row's ``logits`` [vocab], and the ``top`` best alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.numel()))
        best = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprob(token, float(logprobs[token]), best)


PROMPT_CONTEXT = 5  # prompt tokens the stream decodes its first tokens after (vLLM's initial window)


def _cleans_up(tokenizer: Any) -> bool:
    """Does ``tokenizer.decode`` run ``clean_up_tokenization`` on the Rust decoder's text (which a
    ``DecodeStream`` does not)?  As ``transformers`` decides: asked for, and not a BPE model it exempts."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    return forced is None or bool(forced) or type(tokenizer.backend_tokenizer.model).__name__ != "BPE"


def rust_stream(tokenizer: Any, context: Sequence[int], skip_special: bool, spaces_between_special: bool) -> Any:
    """A ``tokenizers`` ``DecodeStream`` primed with ``context`` that gives, piece for piece, the text the window
    method gives through ``tokenizer.decode``; None where it cannot: not a fast tokenizer, a tokenizer class
    that decodes its own way, ``transformers``' clean-up, special tokens kept with spaces around them (the
    Rust decoder joins them without), a context that ends inside a character, or a ``tokenizers`` too old."""
    try:
        import transformers
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    fast, base = transformers.PreTrainedTokenizerFast, transformers.PreTrainedTokenizerBase
    kind = type(tokenizer)
    if not isinstance(tokenizer, fast) or kind._decode is not fast._decode or kind.decode is not base.decode:
        return None
    if (not skip_special and spaces_between_special) or _cleans_up(tokenizer):
        return None
    core = tokenizer.backend_tokenizer
    if core.decode(list(context), skip_special_tokens=skip_special).endswith(REPLACEMENT):
        return None  # a context cut inside a character: DecodeStream would count its bytes as new text
    try:
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special)
    except TypeError:  # a tokenizers older than 0.22 cannot be primed
        return None


class TextStream:
    """The text of one sequence's generated tokens, released in safe pieces.

    ``push(token)`` adds a token; ``take(final)`` returns the text not yet released and whether a stop
    string ended the sequence (the stop string itself and what follows are never released, unless
    ``include_stop_str``).  The window starts with the prompt's last tokens: a SentencePiece decoder drops
    the leading space of a sequence's first token, so "▁Paris" decoded alone is "Paris" while after the
    prompt it is " Paris" (the text equals ``decode(prompt + output)`` minus ``decode(prompt)``).

    ``skip_special`` drops special tokens from the text (vLLM's ``skip_special_tokens``); when they are
    kept, ``spaces_between_special`` puts a space between a special token and the text beside it, as
    ``transformers``' ``spaces_between_special_tokens`` does, whichever tokenizer backs the model.

    ``rust`` off: the window is always decoded through ``tokenizer.decode``, never by a ``DecodeStream``
    (the reference the tests and ``benchmarks/detok_cost.py`` hold the Rust stream to).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: list[str] | None = None,
        *,
        prompt: Sequence[int] = (),
        skip_special: bool = True,
        spaces_between_special: bool = True,
        include_stop_str: bool = False,
        rust: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop or [] if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special, self.spaces_between_special = skip_special, spaces_between_special
        self.include_stop_str = include_stop_str
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.ids: list[int] = []  # the generated tokens
        self.window = self._context(prompt)  # the prompt's tail, then the generated tokens
        self.prefix_offset = 0  # window start: decoded again each time for context
        self.read_offset = len(self.window)  # tokens whose text is already in self.text
        self.text = ""
        self.released = 0  # characters of self.text given out
        self.stopped = False
        self.rust = rust_stream(tokenizer, self.window, skip_special, spaces_between_special) if rust else None
        self.core = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer a DecodeStream steps with

    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's last tokens, from the first that begins a character: a window that starts inside one
        decodes its stray bytes as U+FFFD, and a byte-fallback decoder then turns the whole run of byte tokens
        the output goes on with into U+FFFD too (a prompt ending in 🙂 at the cut, then another 🙂: "����")."""
        tail = list(prompt[-PROMPT_CONTEXT:])
        while tail and self._decode(tail).startswith(REPLACEMENT):
            tail.pop(0)
        return tail

    def _decode(self, ids: list[int]) -> str:
        if self.skip_special or not self.spaces_between_special or not self.special.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        parts: list[str] = []
        run: list[int] = []  # runs of ordinary tokens decoded together, each special token on its own
        for token in ids:
            if token in self.special:
                parts += [self.tokenizer.decode(run, skip_special_tokens=False)] if run else []
                parts.append(self.tokenizer.decode([token], skip_special_tokens=False))
                run = []
            else:
                run.append(token)
        parts += [self.tokenizer.decode(run, skip_special_tokens=False)] if run else []
        return " ".join(parts)

    def push(self, token: int, *, text: bool = True) -> None:
        """Add a generated token; ``text`` off: it counts as generated but adds no text (an EOS that ends
        the sequence, as vLLM leaves out unless the request includes its stop in the output)."""
        self.ids.append(token)
        if not text:
            return
        self.window.append(token)
        piece = self._rust_step(self.rust, token) if self.rust is not None else self._window_step()
        if piece is not None:
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.window)

    def _window_step(self) -> str | None:
        """The text the newest token completes: two decodes of the window, with and without it."""
        prefix = self._decode(self.window[self.prefix_offset : self.read_offset])
        full = self._decode(self.window[self.prefix_offset :])
        return full[len(prefix) :] if len(full) > len(prefix) and not full.endswith(REPLACEMENT) else None

    def _rust_step(self, rust: Any, token: int) -> str | None:
        """The same, kept by the ``DecodeStream``; where it refuses a sequence (its prefix decodes differently
        once a token follows), the window method takes over from the same offsets for the rest of the stream."""
        try:
            piece: str | None = rust.step(self.core, token)
        except Exception:  # tokenizers raises a plain Exception ("Invalid prefix encountered")
            self.rust = None
            return self._window_step()
        return piece

    def resume(self, tokens: list[int], released: int) -> None:
        """Continue a stream begun elsewhere: its ``tokens`` are pushed again (same text, same window)
        and its first ``released`` characters count as given out, so the next ``take`` sends exactly
        what follows them (failover: a client never sees a piece twice)."""
        for token in tokens:
            self.push(token)
        self.released = min(released, len(self.text))

    def take(self, final: bool = False) -> tuple[str, bool]:
        """(new text to send, a stop string was found); after a stop nothing more is released."""
        if self.stopped:
            return "", True
        at = self._first_stop()
        if at is not None:
            self.text = self.text[: at[0] + (len(at[1]) if self.include_stop_str else 0)]
            self.stopped = True
        end = len(self.text) if final or self.stopped else max(self.released, len(self.text) - self.hold)
        piece = self.text[self.released : end]
        self.released = end
        return piece, self.stopped

    def _first_stop(self) -> tuple[int, str] | None:
        """Where the earliest stop string begins, and which one."""
        begin = max(0, self.released - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, begin)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None


def eos_ids(tokenizer: Any, generation_config: dict[str, Any]) -> frozenset[int]:
    """The tokens that end a sequence: the tokenizer's EOS and the checkpoint's generation_config's."""
    found: set[int] = set()
    configured = generation_config.get("eos_token_id")
    for value in [tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])]:
        if isinstance(value, int):
            found.add(value)
    return frozenset(found)
