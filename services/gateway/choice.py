"""One generated choice, end to end across a prefill and a decode worker (docs/request-lifecycle.md, steps 4-12).

Lifecycle of a :class:`ChoiceRun`:

1. Pick the decode worker by prefix overlap and load (``router.py``), and decide where the
   prompt is prefilled (``prefill_policy.py``, on the part that worker has not cached): on the
   best-ranked prefill worker (remote) or by the decode worker itself (local). Router leases
   count the choice as in flight: on its decode worker until it ends, on its prefill worker
   while the prefill runs.
2. Remote: first reserve room for the KV on the decode worker (``decode_admission.py``,
   ``Decode.Reserve``): a full worker refuses at once and the next one is asked, best first; when
   all are full the choice waits (``--decode-admission-timeout``, then 503 ``decode_capacity``).
   The worker that granted is the choice's decode worker, so no prefill is ever computed for a
   worker without room, and the reservation names the prompt and ``cache_salt`` (their digest)
   so that the worker accepts no other KV under the request id. Then start ``Decode.Generate``
   (it waits for the KV) and, concurrently, ``Prefill.Prefill`` with that worker's address:
   prefill ships the KV straight into the reserved blocks; the gateway never sees it. Local: one ``Decode.Generate`` carrying the prompt
   (no reservation: the decode worker's own scheduler waits for blocks, wasting nothing).
3. Relay Generate's messages through the output safety filter: only text the filter released is
   emitted, and each logprob entry is emitted with the text its token produced (held back with
   it), so nothing of a blocked phrase ever leaves.
4. Finish: on the message carrying ``finish_reason``, flush the filter and emit the last event; a
   block ends the choice early with ``content_filter`` and aborts the request on both workers.
5. Any other exit (an error, a failed prefill, the client going away = task cancellation) cancels
   the Generate call and the Prefill call and sends ``Abort`` to the workers concurrently, in a
   task that outlives the cancellation, so every KV block (a reservation included) is freed.

A worker that is down (UNAVAILABLE) before anything was emitted is marked down in the router and
the choice is retried once per remaining worker, under a new backend request id; with every
prefill worker down, the decode worker prefills the prompt itself. A decode worker that dies
mid-stream is *migrated* from (up to ``--max-migrations`` times): another decode worker gets the
prompt plus every token already streamed, recomputes their KV and continues (a seeded choice
continues its random stream), and the relay's state (text, safety filter, logprobs) carries on,
so the client sees one uninterrupted stream. With no migration left the error ends the stream.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from services.common.errors import TandemError, UnavailableError
from services.common.pb import decode_pb2, prefill_pb2
from services.common.prefix_hash import prefix_root, reservation_digest
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.gateway.backend import GenerateStream
from services.gateway.decode_admission import DecodeAdmission
from services.gateway.openai_responses import TokenLogprob
from services.gateway.prefill_policy import PrefillPolicy
from services.gateway.prompt_logprobs import PromptLogprob, from_workers
from services.gateway.router import PromptKeys, Router, WorkerState
from services.gateway.safety import OutputFilter
from services.gateway.token_texts import TokenTexts, to_openai_logprob
from services.gateway.worker_errors import WorkerDown, worker_error

logger = logging.getLogger(__name__)

PREFILL_REPLY_GRACE_S = 5.0
"""How long a finished choice waits for its PrefillResponse (usage's cached tokens, timings)."""
DECODE_DEATH_GRACE_S = 1.0
"""How long a failed prefill waits for its decode stream to say whether the decode worker died."""
FIRST_RENEWAL_S = 1.0
"""When a choice first renews its decode reservation while its prompt waits for a prefill; after
that, every third of the lease the worker granted (10 s at the default 30 s lease)."""


@dataclass(frozen=True, slots=True)
class ChoiceEvent:
    """Text (and its logprobs) now safe to send for choice ``index``; the last has a reason."""

    index: int
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    # the last event of a choice whose request asked for prompt logprobs (prompt_logprobs.py)
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None


@dataclass(slots=True)
class ChoiceStats:
    """What happened to one choice, for usage, metrics and the request's log line."""

    index: int
    request_id: str
    prefill_worker: str = ""  # "" when the decode worker prefilled the prompt itself
    decode_worker: str = ""
    dispatched_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float | None = None
    transfer_s: float | None = None
    queue_s: float | None = None
    finish_reason: str | None = None
    attempts: int = 0
    token_gaps: list[float] = field(default_factory=list)
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # as the prefilling worker sent them


@dataclass(slots=True)
class RelayState:
    """What the relay has seen and sent; it outlives a decode worker, so a migrated stream
    continues the same text, safety filter and logprob bookkeeping."""

    out_filter: OutputFilter
    pending: collections.deque[tuple[int, list[TokenLogprob]]] = field(
        default_factory=collections.deque
    )
    token_ids: list[int] = field(default_factory=list)  # every token id received so far
    produced: int = 0  # characters of text received
    sent: int = 0  # characters the safety filter released
    last: float = 0.0  # when the last message arrived


@dataclass(frozen=True, slots=True)
class ChoiceDeps:
    """What a choice needs from the gateway."""

    router: Router
    new_filter: Callable[[], OutputFilter]
    token_texts: TokenTexts
    prefill_timeout_s: float
    spawn: Callable[[Coroutine[object, object, object]], None]
    prefill_policy: PrefillPolicy = PrefillPolicy()
    count_prefill_path: Callable[[str], None] = lambda path: None
    max_migrations: int = 0
    count_migration: Callable[[], None] = lambda: None
    # None (test doubles only): no reservation; a real decode worker then refuses the KV
    admission: DecodeAdmission | None = None
    prefix_salt: bytes = b""  # the deployment's prefix-cache salt (prefix_hash.prefix_root)


class ChoiceRun:
    """Runs one choice; ``emit`` receives its events in order (see the module lifecycle)."""

    def __init__(
        self,
        deps: ChoiceDeps,
        *,
        index: int,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        emit: Callable[[ChoiceEvent], None],
    ) -> None:
        self._deps = deps
        self._prompt_ids = prompt_ids
        self._params = params
        self._emit = emit
        self._emitted = False
        self._migrations = 0
        self._relay_state = RelayState(deps.new_filter())
        self.stats = ChoiceStats(index=index, request_id=request_id)

    async def run(self) -> ChoiceStats:
        """Generate the choice; raise a TandemError on failure (after cleaning up)."""
        router = self._deps.router
        # Each prefill worker, then the decode worker prefilling itself; or each decode worker.
        max_attempts = max(len(router.workers("prefill")) + 1, len(router.workers("decode")))
        while True:
            self.stats.attempts += 1
            suffix = "" if self.stats.attempts == 1 else f"-r{self.stats.attempts - 1}"
            # A migrated stream is prefilled (prompt + what it streamed) by its new decode worker.
            prompt = PromptKeys(self._prompt_ids + tuple(self._relay_state.token_ids),
                                prefix_root(self._deps.prefix_salt, self._params.cache_salt))
            decode = router.pick("decode", prompt)
            prefill = None if self._migrations else self._remote_prefill_worker(decode, prompt)
            self._deps.count_prefill_path("local" if prefill is None else "remote")
            if prefill is not None and self._deps.admission is not None:  # reserve before compute
                decode = await self._deps.admission.admit(
                    self.stats.request_id + suffix, len(self._prompt_ids), decode,
                    prompt_digest=reservation_digest(self._prompt_ids, self._params.cache_salt),
                    prefill=prefill, prompt=prompt,
                )  # fmt: skip
            try:
                with router.lease(decode):
                    await self._attempt(self.stats.request_id + suffix, prefill, decode)
                return self.stats
            except WorkerDown as down:
                router.mark_down(down.worker, down.error)
                if self._emitted:
                    if (down.worker.client.role != "decode"
                            or self._migrations >= self._deps.max_migrations):  # fmt: skip
                        raise down.error from down
                    self._migrations += 1
                    self._deps.count_migration()
                    logger.warning(
                        "decode worker died mid-stream; migrating the choice",
                        extra={"request_id": self.stats.request_id, "failed": down.worker.address,
                               "tokens_streamed": len(self._relay_state.token_ids)},
                    )  # fmt: skip
                    continue
                if self.stats.attempts >= max_attempts:
                    raise down.error from down
                logger.warning(
                    "retrying choice on another worker",
                    extra={"request_id": self.stats.request_id, "failed": down.worker.address},
                )

    def _remote_prefill_worker(
        self, decode: WorkerState, prompt: PromptKeys
    ) -> WorkerState | None:
        """The prefill worker for this prompt (the best-ranked one the policy accepts), or None
        when ``decode`` prefills it: judged on the part of the prompt ``decode`` has not cached."""
        router, policy = self._deps.router, self._deps.prefill_policy
        uncached = len(self._prompt_ids) - router.cached_tokens(decode, prompt)
        for worker in router.ranked("prefill", prompt=prompt):
            if policy.prefill_remotely(uncached, worker.load()[0]):
                return worker
        return None

    async def _attempt(
        self, rid: str, prefill: WorkerState | None, decode: WorkerState
    ) -> None:
        s = self.stats
        s.prefill_worker = prefill.address if prefill is not None else ""
        s.decode_worker = decode.address
        s.dispatched_at = time.monotonic()
        prefill_task: asyncio.Future[prefill_pb2.PrefillResponse] | None = None
        if prefill is None:
            stream = decode.client.generate(
                rid, prompt_token_ids=self._prompt_ids, params=self._params,
                output_token_ids=self._relay_state.token_ids,
            )  # fmt: skip
        else:
            stream = decode.client.generate(rid)
            prefill_task = asyncio.ensure_future(self._prefill(rid, prefill, decode))
            self._deps.router.lease_until_done(prefill, prefill_task)
            if self._deps.admission is not None:
                renewal = asyncio.ensure_future(self._keep_reserved(rid, decode, prefill_task))
                prefill_task.add_done_callback(lambda _: renewal.cancel())
        clean = False
        try:
            await self._relay(rid, stream, prefill_task, prefill, decode)
            if prefill_task is not None:
                await self._await_prefill_stats(prefill_task)
            clean = True
        finally:
            if not clean:
                stream.cancel()
                if prefill_task is not None:
                    prefill_task.cancel()
                    prefill_task.add_done_callback(_retrieve)
                reason = "gateway: request ended early"
                self._deps.spawn(_abort_all(rid, prefill, decode, reason))

    async def _keep_reserved(
        self, rid: str, decode: WorkerState,
        prefill_task: asyncio.Future[prefill_pb2.PrefillResponse],
    ) -> None:
        """Renew the decode reservation (first after ``FIRST_RENEWAL_S``, then every third of the
        lease granted) until the prefill answers:
        a prompt may wait in a prefill worker's queue (long prompts ahead of it on a small
        machine) longer than a reservation's lease, and an expired one fails the request when its
        KV finally arrives. Ends quietly once the reservation is gone (its KV header took it
        over, or it ended: the prefill's own outcome reports that)."""
        digest = reservation_digest(self._prompt_ids, self._params.cache_salt)
        interval = FIRST_RENEWAL_S
        while not prefill_task.done():  # the prefill's end also cancels this task (_attempt)
            await asyncio.sleep(interval)
            try:
                reply = await decode.client.reserve(rid, len(self._prompt_ids),
                                                    prompt_digest=digest, renew=True)  # fmt: skip
            except TandemError as err:
                logger.debug("reservation not renewed: %s", err.message,
                             extra={"request_id": rid, "worker": decode.address})  # fmt: skip
                return
            if reply is None:  # a worker that predates Reserve: nothing to renew
                return
            interval = max(0.2, reply.lease_seconds / 3)

    async def _prefill(
        self, rid: str, prefill: WorkerState, decode: WorkerState
    ) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=rid,
            token_ids=list(self._prompt_ids),
            params=sampling_params_to_proto(self._params),
            decode_address=decode.address,
            deadline_unix=time.time() + self._deps.prefill_timeout_s,
        )
        try:
            return await prefill.client.prefill(request)
        except TandemError as err:
            mapped = worker_error(err, prefill)
            if mapped is err:
                raise
            raise mapped from err

    async def _next(
        self,
        stream: GenerateStream,
        prefill_task: asyncio.Future[prefill_pb2.PrefillResponse] | None,
        decode: WorkerState,
    ) -> decode_pb2.GenerateResponse | None:
        """The next Generate message; a failed prefill wins over the stream it starves, unless
        the decode worker died (a prefill that fails because its KV hand-off lost the decode
        worker must not hide that: the choice is retried elsewhere)."""
        if prefill_task is None:
            return await self._read(stream, decode)
        if prefill_task.done():
            prefill_task.result()  # raises the prefill's error, if any
            return await self._read(stream, decode)
        read = asyncio.ensure_future(self._read(stream, decode))
        try:
            await asyncio.wait({read, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None:
                if isinstance(prefill_task.exception(), UnavailableError) and not read.done():
                    # Its decode worker may have just died: the stream's error says so.
                    await asyncio.wait({read}, timeout=DECODE_DEATH_GRACE_S)
                if read.done() and not read.cancelled() and isinstance(read.exception(),
                                                                        WorkerDown):  # fmt: skip
                    return await read  # raises WorkerDown(decode)
                prefill_task.result()
            return await read
        finally:
            if not read.done():
                read.cancel()
                read.add_done_callback(_retrieve)  # it may still end with an error, unread
            elif not read.cancelled():
                read.exception()  # mark retrieved: a prefill failure was raised instead

    async def _read(
        self, stream: GenerateStream, decode: WorkerState
    ) -> decode_pb2.GenerateResponse | None:
        try:
            return await stream.next()
        except TandemError as err:
            mapped = worker_error(err, decode)
            if mapped is err:
                raise
            raise mapped from err

    async def _relay(
        self,
        rid: str,
        stream: GenerateStream,
        prefill_task: asyncio.Future[prefill_pb2.PrefillResponse] | None,
        prefill: WorkerState | None,
        decode: WorkerState,
    ) -> None:
        s = self.stats
        relay = self._relay_state
        out_filter, pending = relay.out_filter, relay.pending
        produced, sent = relay.produced, relay.sent
        last = s.dispatched_at if s.first_token_at is None else relay.last
        want_logprobs = self._params.logprobs is not None
        while True:
            msg = await self._next(stream, prefill_task, decode)
            if msg is None:
                raise UnavailableError(
                    f"decode worker {decode.address} ended the stream without a finish reason"
                )
            now = time.monotonic()
            relay.token_ids.extend(msg.token_ids)
            if s.first_token_at is None:
                s.first_token_at = now
                self._send(ChoiceEvent(s.index))  # opens the stream even while text is held
            else:
                s.token_gaps.append(now - last)
            last = now
            s.prompt_tokens = msg.num_prompt_tokens or len(self._prompt_ids)
            if prefill is None and not self._migrations:  # prefilled by the decode worker
                s.cached_tokens = msg.num_cached_tokens
            s.completion_tokens = msg.completion_tokens or s.completion_tokens + len(msg.token_ids)
            if msg.prompt_logprobs and s.prompt_logprobs is None:  # prefilled by the decode worker
                s.prompt_logprobs = from_workers(self._prompt_ids, msg.prompt_logprobs,
                                                 self._deps.token_texts)  # fmt: skip
            produced += len(msg.text)
            if want_logprobs and msg.logprobs:
                lps = [to_openai_logprob(lp, self._deps.token_texts) for lp in msg.logprobs]
                pending.append((produced, lps))
            result = out_filter.push(msg.text)
            finish = msg.finish_reason or None
            if finish is not None and not result.blocked:
                tail = out_filter.finish()
                result = dataclasses.replace(
                    tail, text_to_send=result.text_to_send + tail.text_to_send
                )
            sent += len(result.text_to_send)
            relay.produced, relay.sent, relay.last = produced, sent, now
            released: list[TokenLogprob] = []
            while pending and (pending[0][0] <= sent or (finish and not result.blocked)):
                released.extend(pending.popleft()[1])
            if result.blocked:
                s.finish_reason = "content_filter"
                s.finished_at = now
                self._send(
                    ChoiceEvent(s.index, result.text_to_send, tuple(released), "content_filter")
                )
                stream.cancel()
                self._deps.spawn(_abort_all(rid, prefill, decode, "gateway: output safety filter"))
                return
            if finish is not None:
                s.finish_reason = finish
                s.finished_at = now
                if self._params.prompt_logprobs is not None and prefill_task is not None:
                    await self._await_prefill_stats(prefill_task)  # they come with its reply
                self._send(ChoiceEvent(s.index, result.text_to_send, tuple(released), finish,
                                       s.prompt_logprobs))  # fmt: skip
                return
            if result.text_to_send or released:
                self._send(ChoiceEvent(s.index, result.text_to_send, tuple(released)))

    async def _await_prefill_stats(
        self, prefill_task: asyncio.Future[prefill_pb2.PrefillResponse]
    ) -> None:
        """Take cached tokens and timings from the PrefillResponse (it arrives with the KV ack)."""
        s = self.stats
        try:
            reply = await asyncio.wait_for(prefill_task, PREFILL_REPLY_GRACE_S)
        except (TimeoutError, TandemError, WorkerDown) as err:
            logger.warning(
                "no prefill response for a finished choice",
                extra={"request_id": s.request_id, "error": repr(err)},
            )
            return
        if not isinstance(reply, prefill_pb2.PrefillResponse):
            return
        arrived = time.monotonic()
        s.cached_tokens = reply.num_cached_tokens
        if reply.prompt_logprobs and s.prompt_logprobs is None:
            s.prompt_logprobs = from_workers(self._prompt_ids, reply.prompt_logprobs,
                                             self._deps.token_texts)  # fmt: skip
        s.prefill_s = reply.prefill_seconds
        s.transfer_s = reply.transfer_seconds
        known = reply.prefill_seconds + reply.transfer_seconds
        end = min(arrived, s.first_token_at or arrived)
        s.queue_s = max(0.0, end - s.dispatched_at - known)

    def _send(self, event: ChoiceEvent) -> None:
        self._emitted = True
        self._emit(event)


def _retrieve(task: asyncio.Future[object]) -> None:
    """Mark a task's outcome as seen (its failure was handled or superseded)."""
    if not task.cancelled():
        task.exception()


async def _abort_all(
    rid: str, prefill: WorkerState | None, decode: WorkerState, reason: str
) -> None:
    """Abort ``rid`` on its workers at once (each call never raises)."""
    workers = [decode] if prefill is None else [prefill, decode]
    await asyncio.gather(*(w.client.abort(rid, reason) for w in workers))
