"""How a step travels through a pipeline's stages: Ray's calls (the relay), or direct links between them.

The relay: the engine calls ``stage.forward.remote(ref, table)`` for each stage, chaining the refs.  Every
hand-off then goes through the engine's process (a small result is returned to the ref's owner, which sends it
on with the next call): two messages per hop, and Ray's per-call work in every process, on the head's CPU
too (docs/PERFORMANCE.md S9: 3–4 ms per hop, 2–9 ms of CPU per call under a CPU quota).

Direct links: the engine and the stages form a ring of ``torch.distributed`` point-to-point links (gloo over
TCP, as vLLM's pipeline-parallel ranks send hidden states with ``torch.distributed``): the engine sends a step
to stage 0, each stage sends its output to the next, and the last sends the step's next tokens back to the engine
(int64, one a row: the last stage samples, ``models.sampling``), or its logits when some row needs them.  One
message per hop, no Ray call per step; Ray still places, watches and kills the stage actors.  Every link is
bound to the node's Ray address (``create_device(hostname=ip)``), never to whatever the host name resolves
to, so on hosts with several NICs the links take the network Ray uses.  The ring forms over Ray's calls, with no
store on the network, and every link proves the ring's secret before a step is read from it (``node.rendezvous``).

A step is one message of bytes: a header (int64 ``[kind, ndim, shape padded to 3, dtype, rows, big, height]``),
the ``[height, rows]`` table (slot, start, length per row, a fourth row when some row asks for the logits of
every position, then each row's sampling settings), then the payload (token ids, hidden states, the next tokens or
logits).  A
receiver always has its next receive posted, into a buffer of the ring's ``capacity`` (agreed when it forms:
the largest decode step of the model, ``link_capacity``), so a sender finds it waiting and sends at once: one
message, no exchange between the two processes before the bytes move (gloo sends only into a posted receive;
with a header and then a body of its size, the body waited for the receiver's thread to read the header, take
the GIL and post it — 6-9 ms per hop on a busy head or a throttled host).  A step larger than ``capacity`` (a
prompt's chunk of a large model) sends its header alone, flagged ``big``, and its body after it on a tag of
its own.  Steps come out in the order they went in (one link per pair of neighbours, in order), which the step
anatomy relies on as the relay does.

When a link breaks (a stage died: its connections close at once) the stage's loop ends and the next stage's
receive fails in turn, down to the engine's; a stage whose loop ended answers ``links_ended`` with why, which
the engine watches beside its steps.  A frozen host closes nothing: the engine's stall deadline fails the
pipeline, as with the relay.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raycluster_cli.models.sampling import TABLE_ROWS

HEADER = 9  # kind, the payload's ndim, its shape padded to 3, its dtype, the table's rows, big (its body follows),
# the table's height
TABLE_HEIGHT = TABLE_ROWS  # the most rows of a step's table: slot, start, length, every position's logits, sampling
HEADER_BYTES = HEADER * 8
KIND_IDS, KIND_HIDDEN, KIND_LOGITS = 0, 1, 2
DTYPES = [torch.int64, torch.float32, torch.float16, torch.bfloat16]
# A link waits for the next step for as long as the service is idle: its receive must not time out.
IDLE_FOREVER = datetime.timedelta(days=365)
CONNECT_TIMEOUT_S = 30.0  # the ring forms within this, or the pipeline keeps Ray's calls


def ring_group(store: Any, rank: int, size: int, my_ip: str) -> Any:
    """This process's member of one pipeline's ring: a gloo process group of ``size`` ranks meeting at
    ``store``, its links bound to ``my_ip``.  Its own object, not the process's default group: the engine's process
    holds one per pipeline.  ``store`` is this process's own (``node.rendezvous``: the ranks' address records travel
    over Ray's calls), never one that listens on the network."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the devices are set here only
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=my_ip)]
    options._timeout = IDLE_FOREVER
    return dist.ProcessGroupGloo(store, rank, size, options)


MESSAGE_TAG, BODY_TAG = 0, 1  # steps travel in order on the first tag; a big step's body on the second
MIN_CAPACITY = 64 * 1024


def link_capacity(rows: int, hidden: int, vocab: int, itemsize: int = 4) -> int:
    """The bytes a ring's receivers post for each message: a decode step of ``rows`` rows (one token each) from
    any rank, hidden states or logits, fits.  Only the touched pages of a receive buffer are ever mapped."""
    return max(MIN_CAPACITY, HEADER_BYTES + TABLE_HEIGHT * rows * 8 + rows * max(hidden, vocab) * itemsize)


Sending = tuple[list[Any], list[torch.Tensor]]  # a send's works, and the tensors they read (alive until waited)


def start_send(group: Any, peer: int, kind: int, table: torch.Tensor, payload: torch.Tensor, capacity: int) -> Sending:
    """Send a step without waiting for it."""
    payload = payload.contiguous()
    table = table.contiguous()
    rows = table.shape[1]
    size = HEADER_BYTES + table.numel() * 8 + payload.numel() * payload.element_size()
    big = size > capacity
    shape = list(payload.shape) + [0] * (3 - payload.dim())
    fields = [kind, payload.dim(), *shape, DTYPES.index(payload.dtype), rows, int(big), table.shape[0]]
    header = torch.tensor(fields, dtype=torch.int64)
    parts = [header.view(torch.uint8), table.view(-1).view(torch.uint8), payload.view(-1).view(torch.uint8)]
    if big:
        body = torch.cat(parts[1:])
        return [group.send([header], peer, MESSAGE_TAG), group.send([body], peer, BODY_TAG)], [header, body]
    message = torch.cat(parts)
    return [group.send([message], peer, MESSAGE_TAG)], [message]


def finish_send(sending: Sending | None) -> None:
    if sending is not None:
        for work in sending[0]:
            work.wait()


class Receiver:
    """Steps from one neighbour, in order.  The next message's receive is posted as soon as one is read, so the
    next step lands while this process computes, without this thread's help (see the module's docstring)."""

    def __init__(self, group: Any, peer: int, capacity: int) -> None:
        self.group, self.peer, self.capacity = group, peer, capacity
        self._post()

    def _post(self) -> None:
        self.buffer: torch.Tensor | None = torch.empty(self.capacity, dtype=torch.uint8)
        self.asked = self.group.recv([self.buffer], self.peer, MESSAGE_TAG)

    def next(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(kind, table [height, rows], payload): ids [rows, width], hidden [rows, width, features], next tokens
        [rows] or logits
        [rows, vocab] ([rows, width, vocab] when the table asks for every position's)."""
        self.asked.wait()
        message = self.buffer
        assert message is not None, "closed"
        kind, ndim, *sizes, code, rows, big, height = (int(v) for v in message[:HEADER_BYTES].view(torch.int64))
        dtype, shape = DTYPES[code], sizes[:ndim]
        table_bytes = height * rows * 8
        count = math.prod(shape)
        self._post()
        if big:
            body = torch.empty(table_bytes + count * dtype.itemsize, dtype=torch.uint8)
            self.group.recv([body], self.peer, BODY_TAG).wait()
        else:
            body = message[HEADER_BYTES : HEADER_BYTES + table_bytes + count * dtype.itemsize]
        table = body[:table_bytes].view(torch.int64).view(height, rows)
        payload = body[table_bytes:].view(dtype).view(shape)
        return kind, table, payload

    def close(self) -> None:
        self.group = self.asked = self.buffer = None


class StageLoop:
    """A stage's side of the ring, on a thread of its actor: receive a step, ``forward`` it, send it on.  Its
    output's send completes while it receives and computes the next step (waited before the next send)."""

    def __init__(
        self,
        group: Any,
        rank: int,
        size: int,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        capacity: int = MIN_CAPACITY,
    ) -> None:
        self.group: Any = group
        self.capacity = capacity
        self.forward = forward
        self.previous, self.next = rank - 1, (rank + 1) % size
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="raycluster-links", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        receiver = Receiver(self.group, self.previous, self.capacity)
        sending: Sending | None = None
        try:
            while True:
                _, table, payload = receiver.next()
                out = self.forward(payload, table)
                kind = KIND_HIDDEN if self.next else KIND_IDS if out.dtype == torch.int64 else KIND_LOGITS
                finish_send(sending)
                sending = start_send(self.group, self.next, kind, table, out, self.capacity)
        except BaseException as exc:  # a neighbour gone, or this stage's forward failed: the ring is over
            self.error = f"{type(exc).__name__}: {exc}"
            # dropping the group (every reference: the receiver's, the works') closes this stage's links, so its
            # neighbours' receives fail in turn, down to the engine's: the ring ends at once instead of waiting
            # for a step that never comes
            receiver.close()
            sending = None
            self.group = None

    def wait(self) -> str:
        """Block until the loop ends; why it ended."""
        self.thread.join()
        return self.error or "the links loop ended"


async def first_stage_ended(stages: Sequence[Any]) -> str:
    """Why the first of ``stages`` ended: its ``links_ended`` answer (its links loop ended), or the error of that
    held call (its process died).  A stage without links never answers, so for a relayed pipeline this waits for a
    stage's death."""
    calls = [asyncio.ensure_future(stage.links_ended.remote()) for stage in stages]
    done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
    ended = next(iter(done))
    return f"{type(e).__name__}: {e}" if (e := ended.exception()) else str(ended.result())


class LinksDown(RuntimeError):
    """The ring broke: a stage died or failed (the engine treats it as a failed step)."""


class DirectLinks:
    """The engine's side of the ring: ``run(ids, table)`` sends a step to stage 0 and awaits its result from the
    last stage (next tokens or logits: ``received`` counts each kind); steps in flight come back in order.
    ``watch(stages)`` fails it when a stage's loop ends."""

    def __init__(self, group: Any, size: int, capacity: int = MIN_CAPACITY) -> None:
        self.group: Any = group
        self.size, self.capacity = size, capacity
        self.failure: BaseException | None = None
        self.received: collections.Counter[int] = collections.Counter()  # steps back, by kind: ids or logits
        # called on the loop with the first failure that was not ``close()``: the engine fails at once, also while
        # no step is in flight (a stage that died idle is replaced then, not when the next request meets it)
        self.on_down: Callable[[BaseException], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[asyncio.Future[tuple[torch.Tensor, float]]] = collections.deque()
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._send_all, name="raycluster-links-send", daemon=True),
            threading.Thread(target=self._receive_all, name="raycluster-links-receive", daemon=True),
        ]
        self._watch: asyncio.Task[None] | None = None

    def start(self, stages: Sequence[Any] = ()) -> None:
        self._loop = asyncio.get_running_loop()
        for thread in self._threads:
            thread.start()
        if stages:
            self._watch = self._loop.create_task(self._watch_stages(stages))

    async def run(self, ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The step's result (int64 next tokens [rows], or logits), and the wall time its receive thread had it
        (the engine's loop takes it up later: the difference is the loop's wait, in the step anatomy)."""
        assert self._loop is not None, "start() first"
        if self.failure is not None:
            raise LinksDown(str(self.failure))
        future: asyncio.Future[tuple[torch.Tensor, float]] = self._loop.create_future()
        with self._lock:
            self._waiting.append(future)
        self._outbox.put((ids, table))
        return await future

    def _send_all(self) -> None:
        sending: Sending | None = None
        try:
            while (item := self._outbox.get()) is not None:
                finish_send(sending)
                sending = start_send(self.group, 1, KIND_IDS, item[1], item[0], self.capacity)
        except BaseException as exc:
            sending = None
            self._fail(exc)

    def _receive_all(self) -> None:
        receiver = Receiver(self.group, self.size - 1, self.capacity)
        try:
            while True:
                kind, _, result = receiver.next()
                arrived = time.time()
                self.received[kind] += 1
                with self._lock:
                    future = self._waiting.popleft()
                self._resolve(future, (result, arrived))
        except BaseException as exc:
            receiver.close()
            self._fail(exc)

    def _resolve(self, future: asyncio.Future[tuple[torch.Tensor, float]], result: tuple[torch.Tensor, float]) -> None:
        assert self._loop is not None

        def give() -> None:
            if not future.done():
                future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(give)

    def _fail(self, exc: BaseException) -> None:
        """Every step waiting gets ``LinksDown``; later ``run``s raise at once."""
        down = exc if isinstance(exc, LinksDown) else LinksDown(f"{type(exc).__name__}: {exc}")
        first = self.failure is None
        if first:
            self.failure = down  # not ``exc``: its traceback holds the frames that hold the group
        self.group = None  # the engine's links close with it (once no thread is inside a call): stage 0's loop ends
        self._outbox.put(None)  # the sender ends, dropping its last sends' works (they hold the group too)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        if self._loop is None:
            return

        on_down = self.on_down if first else None

        def tell() -> None:
            for future in waiting:
                if not future.done():
                    future.set_exception(down)
            if on_down is not None:
                on_down(down)

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(tell)

    async def _watch_stages(self, stages: Sequence[Any]) -> None:
        """A stage whose loop ended (or whose actor died) fails the ring at once, not at the stall deadline."""
        self._fail(LinksDown(f"a stage's links ended: {await first_stage_ended(stages)}"))

    def close(self) -> None:
        """Stop sending (the receive thread ends when the stages are killed and its link closes)."""
        self.on_down = None  # the engine closing its own links is not a failure to report
        if self._watch is not None:
            self._watch.cancel()
        self._fail(LinksDown("the pipeline was closed"))
