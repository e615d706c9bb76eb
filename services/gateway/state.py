"""Everything the gateway's handlers share: backend clients, router, policies, limits, metrics
and what the tokenizer service said about the model.

Built once per application by ``app.build_app`` and stored on the aiohttp app; nothing here is a
module-level global, so tests can run several gateways in one process.

The model's facts (``ModelInfo``: name, context length, vocabulary size) come from the tokenizer
service (any replica of the pool, ``tokenizer_pool.py``). The gateway starts even when that
service is not up yet: :meth:`GatewayState.watch_model_info` keeps asking in the background, and
a request arriving before the answer tries once more itself and otherwise gets 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

from aiohttp import web

from services.common.errors import TandemError, UnavailableError
from services.common.metrics import TandemMetrics
from services.common.pb import tokenizer_pb2
from services.gateway.auth import ApiKeyAuth
from services.gateway.backend import Backend
from services.gateway.body_budget import BodyBudget
from services.gateway.grammar_pool import GrammarPool
from services.gateway.choice import ChoiceDeps
from services.gateway.config import GatewayConfig
from services.gateway.decode_admission import DecodeAdmission
from services.gateway.membership import Membership
from services.gateway.rate_limit import AdmissionLimiter, RateLimiter
from services.gateway.router import Router
from services.gateway.safety import SafetyPolicy
from services.gateway.token_texts import TokenIdTexts, TokenTexts, load_token_texts
from services.gateway.tokenizer_pool import INCOMPATIBLE_CODE, TokenizerPool

logger = logging.getLogger(__name__)

MODEL_INFO_RETRY_S = 1.0
CLEANUP_GRACE_S = 5.0


@dataclass(slots=True)
class GatewayState:
    """Shared, long-lived gateway objects (one per application)."""

    config: GatewayConfig
    backend: Backend
    tokenizers: TokenizerPool
    router: Router
    policy: SafetyPolicy
    auth: ApiKeyAuth
    rate_limiter: RateLimiter | None
    admission: AdmissionLimiter
    metrics: TandemMetrics
    membership: Membership
    body_budget: BodyBudget
    grammars: GrammarPool = field(default_factory=GrammarPool)  # grammar_pool.py
    token_limiter: RateLimiter | None = None
    model_info: tokenizer_pb2.ModelInfo | None = None
    token_texts: TokenTexts = field(default_factory=TokenIdTexts)
    created: int = field(default_factory=lambda: int(time.time()))
    _background: set[asyncio.Task[object]] = field(default_factory=set)

    # ---- the model ------------------------------------------------------------------------
    @property
    def served_names(self) -> tuple[str, ...]:
        if self.config.served_model_names:
            return self.config.served_model_names
        return (self.model_info.name,) if self.model_info is not None else ()

    async def require_model_info(self) -> tokenizer_pb2.ModelInfo:
        """The model's facts, fetched now if still unknown.

        Raises:
            UnavailableError: the tokenizer service cannot be reached (HTTP 503).
        """
        if self.model_info is None:
            await self._fetch_model_info()
        if self.model_info is None:  # pragma: no cover - _fetch raises instead
            raise UnavailableError("the model is not loaded yet")
        return self.model_info

    async def _fetch_model_info(self) -> None:
        try:
            info = await self.tokenizers.fetch_model_info()
        except TandemError as err:
            if err.code == INCOMPATIBLE_CODE:  # every replica answered and was refused
                raise
            raise UnavailableError(
                f"the tokenizer service is not available yet: {err.message}",
                code="backend_unavailable",
            ) from err
        if self.model_info is None:
            self.model_info = info
            self.router.model_fingerprint = info.model_fingerprint
            logger.info(
                "serving model %s (context %d tokens, vocab %d)",
                info.name, info.context_length, info.vocab_size,
            )  # fmt: skip
            self.token_texts = await asyncio.to_thread(
                load_token_texts, self.config.vocab_model, info
            )

    async def watch_model_info(self) -> None:
        """Ask the tokenizer service for the model's facts until it answers."""
        while self.model_info is None:
            try:
                await self._fetch_model_info()
            except UnavailableError as err:
                log = logger.warning if err.code == INCOMPATIBLE_CODE else logger.debug
                log("model info not available yet: %s", err.message)
                await asyncio.sleep(MODEL_INFO_RETRY_S)

    # ---- background work ------------------------------------------------------------------
    def spawn(self, coro: Coroutine[object, object, object]) -> None:
        """Run ``coro`` to completion even if the request that started it is cancelled."""
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait (briefly) for cleanup work still running, e.g. aborts at shutdown."""
        tasks = list(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=CLEANUP_GRACE_S)

    def choice_deps(self) -> ChoiceDeps:
        return ChoiceDeps(
            router=self.router,
            new_filter=self.policy.stream_filter,
            token_texts=self.token_texts,
            prefill_timeout_s=self.config.timeouts.prefill_s,
            spawn=self.spawn,
            prefill_policy=self.config.prefill_policy,
            count_prefill_path=self._count_prefill_path,
            max_migrations=self.config.max_migrations,
            count_migration=self.metrics.migrations.inc,
            prefix_salt=self.config.tls.prefix_salt if self.config.tls is not None else b"",
            admission=DecodeAdmission(
                self.router, self.spawn, timeout_s=self.config.decode_admission_timeout_s,
                count_wait=self.metrics.decode_admission_waits.inc,
                count_timeout=self.metrics.decode_admission_timeouts.inc,
            ),
        )

    def _count_prefill_path(self, path: str) -> None:
        self.metrics.prefill_path.labels(path=path).inc()


STATE_KEY = web.AppKey("tandem_gateway_state", GatewayState)
"""Where the application keeps its :class:`GatewayState`."""
