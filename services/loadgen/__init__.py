"""``tandem bench serve``: a load generator for any OpenAI-compatible server, in the box.

It streams chat or text completions at fixed concurrency levels or Poisson arrival rates and
reports what a user sees: TTFT, TPOT, inter-token latency, end-to-end latency, throughput and
goodput under an SLO, with every failed request counted (docs/loadgen.md). It talks HTTP only,
so it measures Tandem, vLLM, llama.cpp's server or TGI alike; it imports only
``services.common`` and ``services.tokenizer`` (the tokenizer counts prompt tokens) and never
torch.

Modules: ``workload`` (prompts), ``arrivals`` (Poisson send times), ``target`` (a server and
its model), ``sse_stream`` (server-sent events), ``token_timing`` (TTFT / ITL / TPOT of one
stream), ``client`` (one streamed request into a ``RequestRecord``, from ``record``), ``runner``
(one load level), ``metrics`` (a level's summary), ``report`` (table and JSON), ``plots``
(PNG figures, matplotlib imported lazily), ``cli`` (the command).
"""
