"""The gateway's configuration: where the backend services are, and how the gateway limits and
times out requests.

One frozen dataclass built once by ``main.run`` from flags and the environment (never at import
time) and handed to :func:`services.gateway.app.build_app`. Secrets (API keys) are not part of it:
they go straight into :class:`~services.gateway.auth.ApiKeyAuth`, so the config can be logged
(the internal-TLS identity's repr shows no key).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import InvalidArgumentError
from services.common.internal_tls import InternalTls
from services.gateway.prefill_policy import PrefillPolicy

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_MAX_IN_FLIGHT_PER_CLIENT = 64  # a quarter of the gateway: one flood leaves room
DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_DECODE_ADMISSION_TIMEOUT_S = 30.0
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_DEFAULT_MAX_TOKENS = 1024
DEFAULT_HEADER_READ_TIMEOUT_S = 15.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_SSE_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_MEMORY_BYTES = 128 * 1024 * 1024
DEFAULT_RESPONSE_STORE_TTL_S = 3600.0
DEFAULT_RESPONSE_STORE_MAX_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """What one HTTP client may hold at the edge (docs/security.md, "The edge").

    Attributes:
        header_read_timeout_s: a connection must deliver a whole request header within this many
            seconds of opening, or of the previous response (aiohttp's keep-alive timer, which
            runs until the next request's header is complete); slower ones are closed.
        max_connections: open client connections at once; a connection past it is answered
            503 and closed before its request is read.
        sse_write_timeout_s: a streamed response whose client takes longer than this to accept
            one write (it stopped reading, and the socket buffers are full) is dropped: the
            request loses its admission slot and its KV is freed on the workers.
        max_body_memory_bytes: request bodies held in memory at once, all clients together; a
            body is counted at its ``Content-Length`` (``max_body_bytes`` when chunked) from
            before it is read until its request ends, and one that does not fit gets 429.
        max_body_memory_per_client_bytes: of that, what one client (an API key, or an address
            without keys) may hold at once; more gets 429 ``client_body_budget``. None: an
            eighth of ``max_body_memory_bytes``, at least one largest body
            (``body_budget.default_per_client_bytes``).
    """

    header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    sse_write_timeout_s: float = DEFAULT_SSE_WRITE_TIMEOUT_S
    max_body_memory_bytes: int = DEFAULT_MAX_BODY_MEMORY_BYTES
    max_body_memory_per_client_bytes: int | None = None

    def validate(self, max_body_bytes: int) -> EdgeLimits:
        for name, flag in (("header_read_timeout_s", "header_read_timeout"),
                           ("sse_write_timeout_s", "sse_write_timeout")):  # fmt: skip
            if not 0 < getattr(self, name) < float("inf"):
                raise InvalidArgumentError(f"--{flag.replace('_', '-')} must be positive",
                                           param=flag)  # fmt: skip
        if self.max_connections < 1:
            raise InvalidArgumentError("--max-connections must be >= 1", param="max_connections")
        if self.max_body_memory_bytes < max_body_bytes:
            raise InvalidArgumentError(
                "--max-body-memory must be at least --max-body-bytes (else no body fits)",
                param="max_body_memory",
            )
        share = self.max_body_memory_per_client_bytes
        if share is not None and not max_body_bytes <= share <= self.max_body_memory_bytes:
            raise InvalidArgumentError(
                "--max-body-memory-per-client must be at least --max-body-bytes and at most "
                "--max-body-memory", param="max_body_memory_per_client")  # fmt: skip
        return self


@dataclass(frozen=True, slots=True)
class BackendTimeouts:
    """Deadlines (seconds) of the gateway's gRPC calls.

    Attributes:
        tokenize_s: one Tokenize / Detokenize call.
        prefill_s: one Prefill call (queueing, compute and the KV hand-off), also sent to the
            worker as ``deadline_unix``; CPU prefill of long prompts under load is slow.
        wait_for_kv_s: how long a decode worker waits for a request's KV (``Generate``).
        generate_idle_s: longest silence tolerated between two Generate messages once the first
            arrived; a wedged decode worker fails the request instead of hanging it.
        control_s: GetStats, GetModelInfo, Abort and health checks.
        reserve_s: one Decode.Reserve: the worker allocates on its engine thread between two
            steps, and a decode step over long contexts on a loaded CPU takes seconds (2.8 s
            measured at 4,096-token contexts, concurrency 4, on 2 cores, where the 5 s of
            ``control_s`` failed a request and marked a live worker down).
    """

    tokenize_s: float = 30.0
    prefill_s: float = 600.0
    wait_for_kv_s: float = 600.0
    generate_idle_s: float = 300.0
    control_s: float = 5.0
    reserve_s: float = 30.0

    def validate(self) -> BackendTimeouts:
        for name in ("tokenize_s", "prefill_s", "wait_for_kv_s", "generate_idle_s", "control_s",
                     "reserve_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be positive", param=name)
        return self


DEFAULT_KV_OVERLAP_WEIGHT = 1.0
DEFAULT_KV_LOAD_WEIGHT = 4.0


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """The weights of the routing cost (see the module docstring)."""

    overlap_weight: float = DEFAULT_KV_OVERLAP_WEIGHT
    load_weight: float = DEFAULT_KV_LOAD_WEIGHT

    def validate(self) -> RoutingWeights:
        if not self.overlap_weight >= 0:
            raise InvalidArgumentError("--kv-overlap-weight must be >= 0",
                                       param="kv_overlap_weight")  # fmt: skip
        if not self.load_weight > 0:
            raise InvalidArgumentError("--kv-load-weight must be > 0", param="kv_load_weight")
        return self

    @property
    def kv_aware(self) -> bool:
        return self.overlap_weight > 0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs besides its secrets.

    Attributes:
        tokenizer_addresses: the tokenizer replicas (``host:port`` each; a DNS name stands for
            every address it resolves to, as for workers; at least one).
        prefill_addresses / decode_addresses: the worker pools (at least one decode worker; no
            prefill worker means every prompt is prefilled by its decode worker; prefill workers
            and no decode worker serve ``/v1/embeddings`` alone: an embedding model's deployment).
        host / port: where the HTTP server listens.
        metrics_port / metrics_host: where Prometheus ``GET /metrics`` is served, on a port of
            its own (never the API's: the API port is open to clients, the metrics port only to
            the monitoring namespace in Kubernetes); ``metrics_port`` None serves none (tests),
            ``metrics_host`` None binds ``host``.
        served_model_names: names accepted in ``model`` and listed by ``/v1/models``; empty means
            the name the tokenizer service reports (ModelInfo.name).
        safety_policy: a policy file, ``None`` for the shipped default, or ``"off"``.
        rate_limit_rpm / rate_limit_burst: per-client request bucket (an API key's id, or the
            client's IP address when auth is off); ``None`` disables it.
        rate_limit_tpm: per-client tokens per minute (prompt tokens plus ``max_tokens``, charged
            at admission; what a request did not generate is given back when it ends); ``None``
            disables it. Its burst is one minute's worth.
        default_max_tokens: ``max_tokens`` of a chat request that names none; ``None`` means
            "until the context is full" (OpenAI's behaviour, ``--default-max-tokens context``).
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (400 above it);
            ``None``: only the context bounds it.
        https_cert / https_key: serve HTTPS with this certificate chain and key (PEM files);
            ``None``: plain HTTP.
        edge: per-connection and memory limits at the edge (:class:`EdgeLimits`).
        max_in_flight: requests admitted at once; more get 429 (no queue).
        max_in_flight_per_client: of those, at most this many from one client (an API key, or
            an address without keys); more get 429 ``client_concurrency``. None: the default,
            ``DEFAULT_MAX_IN_FLIGHT_PER_CLIENT`` per API key when keys are configured, no cap
            without them (one local user, a benchmark at any concurrency).
        max_body_bytes: request bodies above this get 413.
        grammar_workers / grammar_timeout_s: processes that compile structured-output
            constraints off the event loop, and the seconds one compilation may take before it
            gets 400 ``grammar_too_complex`` (``grammar_pool.py``).
        body_read_timeout_s: a request body must arrive whole within this many seconds of its
            headers, or the client gets 408 and is disconnected (a slow-loris client holds no
            admission slot or worker meanwhile: bodies are read before either is taken).
        stats_interval_s: how often worker load and tokenizer health are polled for routing and
            readiness.
        resolve_interval_s: how often tokenizer and worker entries given by DNS name are
            re-resolved (``membership.py``).
        truncate_chats: fit long conversations by dropping the oldest turns (docs/request-lifecycle.md, step 3) instead
            of answering 400.
        tool_call_parser: the model's tool-call format (``tool_calls.TOOL_CALL_PARSERS``;
            ``auto`` reads it from the chat template).
        reasoning_parser: split the reply's thinking into ``reasoning_content``
            (``reasoning.REASONING_PARSERS``; ``none`` leaves it in the content).
        vocab_model: a ``--model`` value (``default`` or a path) whose vocabulary renders
            logprob tokens as text; ``None`` renders them as ``token_id:<id>`` (vLLM's style).
        prefill_policy: which prompts go to the prefill pool (conditional disaggregation).
        max_migrations: how many times one choice's stream may move to another decode worker
            after its worker died mid-stream (0: the stream ends with an error event).
        decode_admission_timeout_s: how long a remote-prefill choice waits for a decode worker
            to reserve room for its KV before it is answered 503 ``decode_capacity``
            (``decode_admission.py``; 0: at once).
        routing: the weights of the KV-aware routing cost (``router.py``).
        timeouts: gRPC deadlines.
        response_store_ttl_s / response_store_max_entries: how long, and how many, responses
            the Responses API keeps for ``store: true`` (``response_store.py``; 0 entries keeps
            none).
        tls: the gateway's internal-TLS identity for its channels to the tokenizer and the
            workers (``services/common/internal_tls.py``); None is refused when the backend
            channels are opened (``InternalTls.plaintext()`` is plaintext).
    """

    tokenizer_addresses: tuple[str, ...]
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    metrics_port: int | None = None
    metrics_host: str | None = None
    served_model_names: tuple[str, ...] = ()
    safety_policy: str | None = None
    rate_limit_rpm: float | None = None
    rate_limit_burst: float | None = None
    rate_limit_tpm: float | None = None
    default_max_tokens: int | None = DEFAULT_DEFAULT_MAX_TOKENS
    max_tokens_limit: int | None = None
    https_cert: str | None = None
    https_key: str | None = None
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_in_flight_per_client: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    grammar_workers: int = 2
    grammar_timeout_s: float = 10.0
    stats_interval_s: float = 1.0
    resolve_interval_s: float = 5.0
    truncate_chats: bool = True
    tool_call_parser: str = "auto"
    reasoning_parser: str = "none"
    vocab_model: str | None = None
    prefill_policy: PrefillPolicy = field(default_factory=PrefillPolicy)
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    decode_admission_timeout_s: float = DEFAULT_DECODE_ADMISSION_TIMEOUT_S
    routing: RoutingWeights = field(default_factory=RoutingWeights)
    timeouts: BackendTimeouts = field(default_factory=BackendTimeouts)
    response_store_ttl_s: float = DEFAULT_RESPONSE_STORE_TTL_S
    response_store_max_entries: int = DEFAULT_RESPONSE_STORE_MAX_ENTRIES
    tls: InternalTls | None = None

    def validate(self) -> GatewayConfig:
        """Raise InvalidArgumentError (naming the flag) on an unusable value; return self."""
        if not self.tokenizer_addresses:
            raise InvalidArgumentError("a tokenizer address is required", param="tokenizer")
        if not self.decode_addresses and not self.prefill_addresses:
            raise InvalidArgumentError("at least one decode address is required (or, to serve "
                                       "embeddings only, a prefill address)", param="decode")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in [0, 65535], got {self.port}", param="port")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidArgumentError("--metrics-port must be in [0, 65535] (or -1: none), got "
                                       f"{self.metrics_port}", param="metrics_port")  # fmt: skip
        if self.metrics_port is not None and self.metrics_port != 0 and (
                self.metrics_port == self.port
                and (self.metrics_host or self.host) == self.host):  # fmt: skip
            raise InvalidArgumentError("--metrics-port must differ from --port: /metrics is not "
                                       "served on the API's port", param="metrics_port")  # fmt: skip
        if self.rate_limit_rpm is not None and not self.rate_limit_rpm > 0:
            raise InvalidArgumentError("rate limit must be positive", param="rate_limit_rpm")
        if self.rate_limit_burst is not None and not self.rate_limit_burst >= 1:
            raise InvalidArgumentError("rate limit burst must be >= 1", param="rate_limit_burst")
        if self.rate_limit_tpm is not None and not self.rate_limit_tpm >= 1:
            raise InvalidArgumentError("token rate limit must be >= 1", param="rate_limit_tpm")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise InvalidArgumentError("--default-max-tokens must be >= 1 (or 'context')",
                                       param="default_max_tokens")  # fmt: skip
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise InvalidArgumentError("--max-tokens-limit must be >= 1",
                                       param="max_tokens_limit")  # fmt: skip
        if (self.default_max_tokens is not None and self.max_tokens_limit is not None
                and self.default_max_tokens > self.max_tokens_limit):  # fmt: skip
            raise InvalidArgumentError("--default-max-tokens must not exceed --max-tokens-limit",
                                       param="default_max_tokens")  # fmt: skip
        if (self.https_cert is None) != (self.https_key is None):
            raise InvalidArgumentError("--https-cert and --https-key go together",
                                       param="https_cert")  # fmt: skip
        if self.max_in_flight < 1:
            raise InvalidArgumentError("max in-flight must be >= 1", param="max_in_flight")
        if self.max_in_flight_per_client is not None and self.max_in_flight_per_client < 1:
            raise InvalidArgumentError("max in-flight per client must be >= 1",
                                       param="max_in_flight_per_client")  # fmt: skip
        if self.grammar_workers < 1 or not 0 < self.grammar_timeout_s < float("inf"):
            raise InvalidArgumentError("--grammar-workers must be >= 1 and --grammar-timeout "
                                       "positive", param="grammar_workers")  # fmt: skip
        if self.max_body_bytes < 1024:
            raise InvalidArgumentError("max body bytes must be >= 1024", param="max_body_bytes")
        if not 0 < self.body_read_timeout_s < float("inf"):
            raise InvalidArgumentError("body read timeout must be positive",
                                       param="body_read_timeout")  # fmt: skip
        if not self.resolve_interval_s > 0:
            raise InvalidArgumentError("resolve interval must be positive", param="resolve_interval")
        if not self.stats_interval_s > 0:
            raise InvalidArgumentError("stats interval must be positive", param="stats_interval")
        if self.max_migrations < 0:
            raise InvalidArgumentError("max migrations must be >= 0", param="max_migrations")
        if not 0 <= self.decode_admission_timeout_s < float("inf"):
            raise InvalidArgumentError("decode admission timeout must be >= 0",
                                       param="decode_admission_timeout")  # fmt: skip
        if not 0 < self.response_store_ttl_s < float("inf"):
            raise InvalidArgumentError("--response-store-ttl must be positive",
                                       param="response_store_ttl")  # fmt: skip
        if self.response_store_max_entries < 0:
            raise InvalidArgumentError("--response-store-max-entries must be >= 0",
                                       param="response_store_max_entries")  # fmt: skip
        self.edge.validate(self.max_body_bytes)
        self.prefill_policy.validate()
        self.routing.validate()
        self.timeouts.validate()
        return self
