"""The engine: model, weight loaders, paged KV cache, block manager, attention, sampler,
scheduler and KV transfer. Only the prefill and decode services import it (it needs torch);
the engine knows nothing about HTTP or gRPC and sees token ids only."""
