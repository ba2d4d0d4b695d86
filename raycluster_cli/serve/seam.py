"""The engine seam: what the text ingress's routes (serve/app.py) ask of whatever generates, and nothing more.

The routes talk to a ``TextEngine``, not to the pool of pipelines' class, so a second backend and a route that
does not generate plug in without reaching through the pool's layers.  Today's one backend is ``serve.pool.Pool``
(pipelines over the stage actors, with failover); it satisfies the protocol as it is.

How a backend plugs in:

1. It offers ``generate`` as below: one generation's ``Output`` pieces (``serve.engine.Output``: new text, the
   tokens so far, the finish reason, the prompt's token count, log-probabilities when the sampling asks), the
   first awaited before the answer starts.  A refusal before the first output raises ``QueueFull`` (503, full),
   ``EngineDown`` (503, not ready), ``BadInput`` or ``ValueError`` (400); a failure after it ``RequestFailed``
   (500) or ``EngineDown``: the routes turn these into OpenAI's errors (``serve.answers.refusal``) and a stream's
   last event.  Closing the generator (``aclose``) ends the generation and frees what it held.
2. The ingress builds it in ``OpenAIServer.__init__`` and sets ``self.engine`` to it; its health (what
   ``check_health`` raises and ``/health`` counts) and its part of ``/raycluster/status`` stay the ingress's,
   which owns its lifecycle.  Tokenizing, the request's limits, keys and the answer's shape (serve/answers.py)
   stay in front of the seam, the same for every backend.
3. A route that does not generate adds its method here (``embed``, for /v1/embeddings, is the next one): the
   routes call it on ``self.engine``; a backend without it is refused at build time by the type checker, not at
   a request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from raycluster_cli.serve.engine import Output
from raycluster_cli.serve.text import Sampling


class TextEngine(Protocol):
    """What generates a request's tokens for the text routes."""

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: list[str] | None = None,
        *,
        stream: bool,
        choice: int = 0,
    ) -> AsyncGenerator[Output, None]:
        """One generation of ``prompt``: at most ``max_tokens`` tokens sampled as ``sampling`` says, ended early by
        ``stop``; ``stream``: the pieces are released as they come (else the whole answer is awaited, and a
        backend may run it again elsewhere when it failed before anything was sent); ``choice``: which of the
        request's ``n`` generations this is (a backend counts the request and its prompt once, with the first)."""
        ...
