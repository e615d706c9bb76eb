"""Quantized weight storage: GGUF-style blocks held in one canonical, row-major form."""
