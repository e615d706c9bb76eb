"""A Q4_K_M-shaped GGUF of a real model shape with random, valid K-quant blocks, for speed runs
on machines without llama.cpp's converter (``bench/family_ggufs.py`` makes the real thing).

    python bench/random_gguf.py OUT.gguf [--shape llama-3.2-1b]

The shape comes from ``services/engine/core/loaders/dummy.py``'s table (Llama-family shapes);
the vocabulary and tokenizer are SmolLM2's (copied from the default model's GGUF), so the head
is 49,152 rows. Matrices are Q4_K, with Q6_K for the embedding, and for ``attn_v`` and
``ffn_down`` of every other layer, as llama-quantize's Q4_K_M mix lays them out. Blocks are random
bytes with small float16 super-block scales (finite activations), so the bytes a decode step
reads and the kernels it runs are a real file's; the text it writes is noise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.model_source import default_model_path  # noqa: E402
from services.engine.core.loaders.dummy import DUMMY_SHAPES  # noqa: E402

logger = logging.getLogger("random_gguf")
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of each block's float16 scales


def copy_tokenizer(source: GGUFReader, writer: GGUFWriter) -> int:
    """The ``tokenizer.*`` fields of ``source``; returns its vocabulary size."""
    vocab = 0
    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.STRING:
                values: list[object] = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            if name == "tokenizer.ggml.tokens":
                vocab = len(values)
            writer.add_array(name, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(name, bool(field.parts[field.data[0]][0]))
        elif kind == GGUFValueType.UINT32:
            writer.add_uint32(name, int(field.parts[field.data[0]][0]))
    return vocab


def blocks(rng: np.random.Generator, ggml_type: T, rows: int, cols: int) -> np.ndarray:
    """``rows x cols`` weights of ``ggml_type`` as raw blocks: random bytes, small scales."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scale = (rng.random(n) * 1e-3 + 1e-4).astype(np.float16)
        raw[:, offset : offset + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // block * size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama-3.2-1b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = DUMMY_SHAPES[args.shape]
    if config.architecture != "llama":
        raise SystemExit(f"{args.shape}: only Llama-family shapes are written here")
    writer = GGUFWriter(args.out, "llama")
    vocab = copy_tokenizer(GGUFReader(default_model_path()), writer)
    hidden, ff, layers = config.hidden_size, config.intermediate_size, config.num_layers
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(dim)
    writer.add_file_type(15)  # MOSTLY_Q4_K_M
    rng = np.random.default_rng(0)

    def add(name: str, ggml_type: T, rows: int, cols: int) -> None:
        data = blocks(rng, ggml_type, rows, cols)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=ggml_type)

    add("token_embd.weight", T.Q6_K, vocab, hidden)  # tied: also the head
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        p, mixed = f"blk.{i}.", T.Q6_K if i % 2 == 0 else T.Q4_K
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        add(p + "attn_q.weight", T.Q4_K, heads * dim, hidden)
        add(p + "attn_k.weight", T.Q4_K, kv_heads * dim, hidden)
        add(p + "attn_v.weight", mixed, kv_heads * dim, hidden)
        add(p + "attn_output.weight", T.Q4_K, hidden, heads * dim)
        add(p + "ffn_gate.weight", T.Q4_K, ff, hidden)
        add(p + "ffn_up.weight", T.Q4_K, ff, hidden)
        add(p + "ffn_down.weight", mixed, hidden, ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("%s: %s, %d MB", args.out, args.shape, Path(args.out).stat().st_size >> 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
