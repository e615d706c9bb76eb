"""A small Llama GGUF holding every block type Tandem loads, written with the ``gguf`` package, for
tests that must see each type's blocks take a path (tensor parallelism's split on block
boundaries: ``tests/test_tensor_parallel_quantized.py``).

The blocks are random bytes with their float16 scale fields set to small finite values (the
``gguf`` package quantizes only some of these types, and what is under test is where each block
goes, not how it was rounded): every stored value is some block's legitimate value. Each of the 8
types is the ``o_proj`` (row-parallel: split by input columns) of one layer and the ``down_proj``
of another, and the column-parallel ``q/k/v/gate/up`` cycle through all 8 too, so every type is
split both ways, and the fused ``qkv_proj`` / ``gate_up_proj`` hold parts of different types (as a
Q4_K_M file's do).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# per type: (bytes per block, values per block, byte offsets of its float16 scales)
_BLOCKS: dict[T, tuple[int, int, tuple[int, ...]]] = {
    T.Q4_0: (18, 32, (0,)), T.Q4_1: (20, 32, (0, 2)), T.Q5_0: (22, 32, (0,)),
    T.Q5_1: (24, 32, (0, 2)), T.Q8_0: (34, 32, (0,)), T.Q4_K: (144, 256, (0, 2)),
    T.Q5_K: (176, 256, (0, 2)), T.Q6_K: (210, 256, (208,)),
}  # fmt: skip

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS, VOCAB = 512, 8, 4, 64, 1024, 8, 1001


def random_blocks(rng: np.random.Generator, ggml_type: T, rows: int, cols: int,
                  scale: float) -> np.ndarray:  # fmt: skip
    """``rows`` rows of ``cols`` values of random ``ggml_type`` blocks (uint8 ``[rows, bytes]``),
    their float16 scales of magnitude about ``scale`` (so the model's activations stay sane)."""
    size, per, offsets = _BLOCKS[ggml_type]
    assert cols % per == 0
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, size=(rows, cols // per)) * scale
    # the second float16 is an offset: Q4_1 / Q5_1's min (about -8 scales, centring q = 0..15),
    # the K types' dmin (about 7.5 times d, centring q * sc against m, both 6-bit)
    second = -8 * d if ggml_type in (T.Q4_1, T.Q5_1) else 7.5 * d
    for offset, values in zip(offsets, (d, second)):
        half = values.astype(np.float16)
        blocks[:, :, offset : offset + 2] = half.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


# per type: the mean magnitude of ``q * sc`` (its integer value times its 6-bit or 8-bit
# sub-block scale, or its centred value alone), so a block scale of ``target / this`` gives
# values of about ``target``
_SPREAD = {T.Q4_0: 4.0, T.Q4_1: 4.0, T.Q5_0: 8.0, T.Q5_1: 8.0, T.Q8_0: 64.0, T.Q4_K: 120.0,
           T.Q5_K: 240.0, T.Q6_K: 1000.0}  # fmt: skip


def _scale(ggml_type: T, cols: int) -> float:
    """A block scale that gives values of about ``1 / sqrt(cols)`` (activations of about unit
    size after every matrix; logits of a few units)."""
    return 1.0 / np.sqrt(cols) / _SPREAD[ggml_type]


def write_quantized_llama(path: Path, seed: int = 0) -> Path:
    """Write the GGUF (see the module docstring) to ``path``."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, ggml_type: T, rows: int, cols: int) -> None:
        data = random_blocks(rng, ggml_type, rows, cols, _scale(ggml_type, cols))
        writer.add_tensor(name, data, raw_dtype=ggml_type)

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))

    matrix("token_embd.weight", T.Q4_K, VOCAB, HIDDEN)
    column = 0  # the column-parallel matrices cycle through the types
    for layer in range(LAYERS):
        prefix = f"blk.{layer}."
        norm(prefix + "attn_norm.weight")
        norm(prefix + "ffn_norm.weight")
        for name, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM),
                           ("attn_v", KV_HEADS * HEAD_DIM), ("ffn_gate", INTERMEDIATE),
                           ("ffn_up", INTERMEDIATE)):  # fmt: skip
            matrix(f"{prefix}{name}.weight", TYPES[column % len(TYPES)], rows, HIDDEN)
            column += 1
        matrix(prefix + "attn_output.weight", TYPES[layer], HIDDEN, HEADS * HEAD_DIM)
        matrix(prefix + "ffn_down.weight", TYPES[(layer + 3) % len(TYPES)], HIDDEN, INTERMEDIATE)
    norm("output_norm.weight")
    matrix("output.weight", T.Q6_K, VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
