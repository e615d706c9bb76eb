"""Long-lived CPU tensors (the kernels' weight tiles, the KV pool) in transparent huge pages.

A batch-1 decode step streams every weight byte from memory once. Through 4 KiB pages that is a
TLB miss every 4 KiB, a page walk each (two nested walks on a virtual machine), and the hardware
prefetchers stop at every page boundary: on a 2-vCPU Zen 4 VM a plain two-thread read of 700 MB
ran at well under two thirds of the rate it reached from 2 MiB pages, and the decode kernels'
rows gained a fifth (docs/benchmarks.md, "Weights and KV in huge pages"). Linux gives an
anonymous mapping huge pages when the system's ``transparent_hugepage/enabled`` is ``always``, or
``madvise`` (a common default) and the mapping asked with ``MADV_HUGEPAGE``; PyTorch's allocator
asks only when ``THP_MEM_ALLOC_ENABLE`` is set before its first allocation, which a library
cannot arrange.

So :class:`HugePageArena` carves tensors out of its own mappings: private anonymous ``mmap``
chunks, advised ``MADV_HUGEPAGE`` before any page is touched, each tensor starting on a
:data:`ALIGN`-byte boundary inside a chunk whose usable part starts on a 2 MiB boundary (the
mapping's unaligned head is never touched, so it costs address space, not memory). A chunk lives
as long as any tensor carved from it. Pages only move data: a tensor's values, and every result
computed from them, are the same bits in either kind of page.

:func:`return_free_heap` hands the C heap's free pages back to the system after a load: the copies
into the arena (and the loader's own scratch) leave the freed originals in glibc's heap, which
keeps them resident otherwise (about as many bytes as the model's tiles).

:func:`huge_page_arena` returns one, or ``None`` where huge pages cannot be had (not Linux, the
system set to ``never``) or ``TANDEM_HUGE_PAGES=0`` turns them off (for side-by-side
measurements).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # the x86-64 and arm64 (4 KiB granule) transparent huge page
ALIGN = 64  # a cache line: where every tensor in the arena starts
CHUNK = 64 << 20  # a fresh chunk's size, unless one tensor needs more
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = THP_SETTING) -> str:
    """The system's transparent huge page mode (``always``, ``madvise`` or ``never``; the bracketed
    word of the setting), or ``""`` where there is none (not Linux, no THP)."""
    try:
        text = setting.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_pages_on() -> bool:
    """Whether this process's long-lived tensors go in huge pages: not with ``TANDEM_HUGE_PAGES=0``
    nor where they are unavailable (no ``madvise``, THP ``never`` or absent)."""
    if os.environ.get("TANDEM_HUGE_PAGES", "1") == "0":
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_page_arena() -> HugePageArena | None:
    """An arena for this process's long-lived tensors, or ``None`` where :func:`huge_pages_on`
    says no."""
    return HugePageArena() if huge_pages_on() else None


class HugePageArena:
    """Tensors carved out of huge-page-advised mappings (see the module docstring).

    Not thread-safe: one loader fills it. ``chunk`` is the size of a fresh mapping's usable part
    (a tensor larger than that gets a mapping of its own size, rounded up to whole huge pages).
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        if chunk <= 0 or chunk % HUGE_PAGE:
            raise ValueError(f"an arena chunk is a positive multiple of {HUGE_PAGE} bytes")
        self.chunk = chunk
        self._free = torch.empty(0, dtype=torch.uint8)  # the current chunk's unused tail
        self.mapped = 0  # bytes of usable chunk made so far (a chunk's unused tail included)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in huge pages (fresh chunk memory reads as zeros)."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        padded = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if padded > self._free.numel():
            self._free = self._new_chunk(max(self.chunk, -(-padded // HUGE_PAGE) * HUGE_PAGE))
        region, self._free = self._free[:padded], self._free[padded:]
        return region[:nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a new contiguous tensor in huge pages (CPU tensors only)."""
        if tensor.device.type != "cpu":
            raise ValueError("only CPU tensors go in a huge-page arena")
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def _new_chunk(self, usable: int) -> torch.Tensor:
        """A private anonymous mapping of ``usable`` bytes from a huge-page boundary, advised
        ``MADV_HUGEPAGE`` before any page of it is touched."""
        mapping = mmap.mmap(-1, usable + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        start = -whole.data_ptr() % HUGE_PAGE
        self.mapped += usable
        return whole[start : start + usable]


def return_free_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False where
    the C library has no such call (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
