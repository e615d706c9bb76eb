"""Torch-free code shared by every Tandem service: errors, model lookup, sampling parameters,
gRPC helpers, metrics and logging. The gateway and the tokenizer service import only this part
(never torch), so keep it free of heavy imports."""
