"""OpenAI's frequency and presence penalties as a ``transformers`` logits processor: the reference for them.

OpenAI documents them as ``logit - frequency * count - presence * (count > 0)``, the counts over the tokens generated
so far; transformers has no processor of its own for them, so ``generate`` takes this one.
"""

from __future__ import annotations

from typing import Any


class OpenAIPenalties:
    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        generated = input_ids[:, self.prompt_length :]
        counts = scores.new_zeros(scores.shape).scatter_add_(1, generated, scores.new_ones(generated.shape))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
