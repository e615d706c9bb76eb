"""The engine, in three layers that import downward only (docs/architecture.md):

* ``core`` — the model, weight loaders, quantized weights, CPU kernels, paged KV pool, block
  manager, attention, sampler, scheduler and the step loop (``LLMEngine``): torch, no gRPC, no
  protobuf;
* ``runtime`` — the engine thread, request plumbing, stats and the worker start-up shared by
  the prefill and decode services;
* ``kv_transfer`` — the only code that turns KV blocks into bytes on a wire.

Only the prefill and decode services (and ``tandem generate``) import it: it needs torch."""
