"""The tile formats' codes, as the C kernels number them (``cpu_qgemv.c``'s format enum).

Its own module so that what only names a format (the loaders, the prefetch tuning) needs no
kernel module, and the kernel modules can use those.
"""

from __future__ import annotations

from services.engine.core.quant.quantized_weight import (
    FORMAT_BF16,
    FORMAT_F16,
    FORMAT_Q4,
    FORMAT_Q4_K,
    FORMAT_Q5,
    FORMAT_Q5_K,
    FORMAT_Q6_K,
    FORMAT_Q8_0,
)

# A tile format with no canonical one of its own: q5 whose offset is -16 times its scale (GGUF's
# Q5_0), tiled without the offset (the kernels derive it) so the tiles hold the file's 22 bytes
# per 32 weights, not 24. :meth:`CpuQGemv.tile_format` says which a weight takes.
TILE_Q5_0 = "q5_0"
FORMAT_CODES = {
    FORMAT_Q8_0: 0, FORMAT_Q4: 1, FORMAT_BF16: 2, FORMAT_F16: 3, FORMAT_Q5: 4, FORMAT_Q6_K: 5,
    FORMAT_Q4_K: 6, FORMAT_Q5_K: 7, TILE_Q5_0: 8,
}  # fmt: skip
