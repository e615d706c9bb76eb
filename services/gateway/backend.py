"""gRPC clients of the three backend services, as the gateway uses them.

Every call carries a deadline from :class:`~services.gateway.config.BackendTimeouts`, and every
failed RPC is re-raised as the typed :class:`~services.common.errors.TandemError` the server meant
(:func:`~services.common.grpc_errors.status_to_error`), so handlers only ever see typed errors:
an UNAVAILABLE worker becomes a 503, a bad prompt a 400 naming its ``param``.

- :class:`TokenizerClient`: Tokenize, Detokenize (whole id lists, for checking token-id prompts),
  GetModelInfo, health.
- :class:`WorkerClient`: one prefill or decode worker: Prefill, Embed, Reserve (decode room before a
  prefill starts), Generate (as a :class:`GenerateStream` that can be cancelled), Abort (never
  raises: cleanup must not fail), GetStats, the prefix-cache feed (``PrefixCache.Watch``), health.
- :class:`Backend`: all of them over one mutual-TLS channel per address and server role
  (``services/common/internal_tls.py``), each client made once per address; ``await close()``
  closes them. The pools over them are ``tokenizer_pool.py`` (tokenizer replicas, with retry)
  and ``router.py`` (workers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from services.common.grpc_channel import open_channel
from services.common.internal_tls import InternalTls
from services.common.grpc_errors import status_to_error
from services.common.sampling_params import SamplingParams
from services.common.wire import sampling_params_to_proto
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    prefix_cache_pb2,
    prefix_cache_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.gateway.config import BackendTimeouts, GatewayConfig

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
UNSUPPORTED_CODE = "unsupported"
"""``TandemError.code`` of a call the worker does not implement (an older worker)."""
SERVICE_NAMES: dict[str, str] = {
    "tokenizer": "tandem.v1.Tokenizer",
    "prefill": "tandem.v1.Prefill",
    "decode": "tandem.v1.Decode",
}


async def _health(channel: grpc.aio.Channel, service: str, timeout: float) -> str:
    """``"SERVING"``, another health status name, or the RPC failure as ``"CODE: details"``."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details() or ''}".rstrip(": ")
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class TokenizerClient:
    """One tokenizer replica (``tokenizer_pool.py`` spreads calls over them and retries)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, timeouts: BackendTimeouts) -> None:
        self.address = address
        self._channel = channel
        self._stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        self._timeouts = timeouts

    async def tokenize(
        self, request: tokenizer_pb2.TokenizeRequest
    ) -> tokenizer_pb2.TokenizeResponse:
        try:
            return await self._stub.Tokenize(request, timeout=self._timeouts.tokenize_s)
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> str:
        """The whole text of ``token_ids`` (one Detokenize stream: config, ids, half-close)."""
        messages = [
            tokenizer_pb2.DetokenizeRequest(
                config=tokenizer_pb2.DetokenizeConfig(skip_special_tokens=skip_special_tokens)
            ),
            tokenizer_pb2.DetokenizeRequest(ids=tokenizer_pb2.TokenIds(token_ids=list(token_ids))),
        ]

        async def requests() -> AsyncIterator[tokenizer_pb2.DetokenizeRequest]:
            for message in messages:
                yield message

        parts: list[str] = []
        try:
            call = self._stub.Detokenize(requests(), timeout=self._timeouts.tokenize_s)
            async for reply in call:
                parts.append(reply.text)
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err
        return "".join(parts)

    async def model_info(self) -> tokenizer_pb2.ModelInfo:
        try:
            return await self._stub.GetModelInfo(
                tokenizer_pb2.ModelInfoRequest(), timeout=self._timeouts.control_s
            )
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err

    async def health(self) -> str:
        return await _health(self._channel, SERVICE_NAMES["tokenizer"], self._timeouts.control_s)


class GenerateStream:
    """One ``Decode.Generate`` call: read messages one by one, or cancel it."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, address: str, *, first_s: float, idle_s: float
    ) -> None:
        self._call = call
        self._address = address
        self._first_s = first_s
        self._idle_s = idle_s
        self._started = False

    async def next(self) -> decode_pb2.GenerateResponse | None:
        """The next message, or None at the end of the stream.

        The first message must come within ``first_s`` (the worker's own KV wait plus a margin),
        each later one within ``idle_s``: a wedged worker fails the request instead of hanging it,
        while a long generation may still run for as long as it keeps producing.

        Raises:
            TandemError: the RPC failed (UnavailableError when the worker went silent).
        """
        limit = self._idle_s if self._started else self._first_s
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
            # arrives as the read completes, so a fast stream whose client left kept running.
            async with asyncio.timeout(limit):
                reply = await self._call.read()
        except TimeoutError as err:
            self.cancel()
            raise UnavailableError(
                f"decode worker {self._address} sent nothing for {limit:g}s"
            ) from err
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err
        if reply is grpc.aio.EOF:
            return None
        self._started = True
        return reply

    def cancel(self) -> None:
        """Cancel the RPC (idempotent); the decode worker sees the cancellation and frees."""
        self._call.cancel()


class WorkerClient:
    """One prefill or decode worker."""

    def __init__(
        self, role: Role, address: str, channel: grpc.aio.Channel, timeouts: BackendTimeouts
    ) -> None:
        self.role: Role = role
        self.address = address
        self._channel = channel
        self._timeouts = timeouts
        self._prefill = prefill_pb2_grpc.PrefillStub(channel) if role == "prefill" else None
        self._decode = decode_pb2_grpc.DecodeStub(channel) if role == "decode" else None
        # Abort and GetStats have the same shape on both services.
        self._control: Any = self._prefill if self._prefill is not None else self._decode

    def __repr__(self) -> str:
        return f"WorkerClient({self.role}@{self.address})"

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        if self._prefill is None:
            raise TypeError(f"{self!r} is not a prefill worker")  # a programming error
        try:
            return await self._prefill.Prefill(request, timeout=self._timeouts.prefill_s)
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err

    async def embed(self, request: prefill_pb2.EmbedRequest) -> prefill_pb2.EmbedResponse:
        """Pooled vectors of ``request``'s inputs (``Prefill.Embed``; deadline ``prefill_s``).
        Cancelling the caller cancels the RPC, and the worker drops the inputs it still queues.

        Raises:
            TandemError: the RPC failed (typed: a bad input is an InvalidArgumentError).
        """
        if self._prefill is None:
            raise TypeError(f"{self!r} is not a prefill worker")  # a programming error
        try:
            return await self._prefill.Embed(request, timeout=self._timeouts.prefill_s)
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err

    async def reserve(
        self,
        request_id: str,
        num_tokens: int,
        lease_seconds: float = 0.0,
        *,
        prompt_digest: bytes,
        renew: bool = False,
    ) -> decode_pb2.ReserveResponse | None:
        """Reserve room for ``num_tokens`` prompt tokens' KV on this decode worker before their
        prefill starts (``lease_seconds`` 0: the worker's default lease), for the one prompt and
        ``cache_salt`` whose ``prefix_hash.reservation_digest`` is ``prompt_digest`` (the only
        KV the worker will then accept under ``request_id``). None when the worker predates
        ``Reserve`` (UNIMPLEMENTED): its KV is then placed when it arrives, as before.
        ``renew``: extend this gateway's reservation of ``request_id`` instead (NotFoundError
        when it is gone).

        Raises:
            ResourceExhaustedError: no room now (nothing was reserved).
            TandemError: any other failure (typed; deadline ``reserve_s``).
        """
        if self._decode is None:
            raise TypeError(f"{self!r} is not a decode worker")
        request = decode_pb2.ReserveRequest(
            request_id=request_id, num_tokens=num_tokens, lease_seconds=lease_seconds,
            prompt_digest=prompt_digest, renew=renew,
        )
        try:
            return await self._decode.Reserve(request, timeout=self._timeouts.reserve_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise status_to_error(err) from err

    def generate(
        self,
        request_id: str,
        *,
        prompt_token_ids: Sequence[int] = (),
        params: SamplingParams | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> GenerateStream:
        """Start ``Generate`` now (the RPC begins before the first read). With
        ``prompt_token_ids`` (and ``params``) the decode worker prefills the prompt itself;
        without, it waits for the KV a prefill worker sends."""
        if self._decode is None:
            raise TypeError(f"{self!r} is not a decode worker")
        wait = self._timeouts.wait_for_kv_s
        request = decode_pb2.GenerateRequest(request_id=request_id, wait_for_kv_seconds=wait)
        if prompt_token_ids:
            if params is None:
                raise TypeError("a local prefill needs its sampling params")  # a programming error
            request.prompt_token_ids.extend(prompt_token_ids)
            request.output_token_ids.extend(output_token_ids)  # a migrated stream resumes
            request.params.CopyFrom(sampling_params_to_proto(params))
            wait = self._timeouts.prefill_s  # the first message comes after the prefill
        call = self._decode.Generate(request)
        first = wait + self._timeouts.control_s
        return GenerateStream(
            call, self.address, first_s=first, idle_s=self._timeouts.generate_idle_s
        )

    async def abort(self, request_id: str, reason: str) -> bool:
        """Ask the worker to drop everything it holds for ``request_id``; never raises."""
        request = common_pb2.AbortRequest(request_id=request_id, reason=reason)
        try:
            reply = await self._control.Abort(request, timeout=self._timeouts.control_s)
        except grpc.aio.AioRpcError as err:
            logger.warning(
                "abort failed",
                extra={"request_id": request_id, "worker": self.address, "error": err.code().name},
            )
            return False
        except Exception:
            logger.warning("abort failed", extra={"request_id": request_id}, exc_info=True)
            return False
        return bool(reply.found)

    async def watch_prefix_cache(self) -> AsyncIterator[prefix_cache_pb2.PrefixCacheUpdate]:
        """The worker's ``PrefixCache.Watch`` stream: a snapshot, then changes (no deadline: it
        lasts as long as the worker). Cancel by closing the iterator or its task.

        Raises:
            TandemError: the stream failed; ``code == UNSUPPORTED_CODE`` when the worker does not
                serve it.
        """
        call = prefix_cache_pb2_grpc.PrefixCacheStub(self._channel).Watch(
            prefix_cache_pb2.WatchPrefixCacheRequest()
        )
        try:
            async for update in call:
                yield update
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise FailedPreconditionError(
                    f"{self.address} serves no prefix-cache feed", code=UNSUPPORTED_CODE
                ) from err
            raise status_to_error(err) from err
        finally:
            call.cancel()

    async def stats(self) -> common_pb2.WorkerStats:
        try:
            return await self._control.GetStats(
                common_pb2.StatsRequest(), timeout=self._timeouts.control_s
            )
        except grpc.aio.AioRpcError as err:
            raise status_to_error(err) from err

    async def health(self) -> str:
        return await _health(self._channel, SERVICE_NAMES[self.role], self._timeouts.control_s)


class Backend:
    """Channels and clients for every backend address of a :class:`GatewayConfig`."""

    def __init__(self, config: GatewayConfig) -> None:
        if config.tls is None:
            raise InvalidArgumentError(
                "the gateway needs an internal TLS identity (--tls-cert/--tls-key/--tls-ca, or "
                "--insecure-internal)", param="tls")
        self._tls: InternalTls = config.tls
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._timeouts = config.timeouts
        self._tokenizers: dict[str, TokenizerClient] = {}
        self._workers: dict[tuple[Role, str], WorkerClient] = {}
        self.tokenizers = tuple(self.tokenizer(a) for a in config.tokenizer_addresses)
        self.prefill = tuple(self.worker("prefill", a) for a in config.prefill_addresses)
        self.decode = tuple(self.worker("decode", a) for a in config.decode_addresses)

    def tokenizer(self, address: str) -> TokenizerClient:
        """The client of the tokenizer replica at ``address`` (made once, then reused)."""
        if address not in self._tokenizers:
            self._tokenizers[address] = TokenizerClient(
                address, self._channel(address, "tokenizer"), self._timeouts
            )
        return self._tokenizers[address]

    def worker(self, role: Role, address: str) -> WorkerClient:
        """The client of the ``role`` worker at ``address`` (made once, then reused)."""
        key = (role, address)
        if key not in self._workers:
            self._workers[key] = WorkerClient(role, address, self._channel(address, role),
                                              self._timeouts)  # fmt: skip
        return self._workers[key]

    def _channel(self, address: str, server_role: str) -> grpc.aio.Channel:
        """One mutual-TLS channel per address and role; the server must prove ``server_role``."""
        key = (address, server_role)
        if key not in self._channels:
            self._channels[key] = open_channel(address, tls=self._tls, server_role=server_role)
        return self._channels[key]

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
