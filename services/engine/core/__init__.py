"""The engine core: model, loaders, kernels, KV pool, block manager, attention, sampler,
scheduler and ``LLMEngine``. Token ids in, token ids out; no gRPC, no protobuf, no HTTP."""
