"""Kernel and instruction-set control for the benchmarks: which sets to measure, forcing one
(``TANDEM_CPU_ISA``) or none (``TANDEM_CPU_KERNELS=0``) for a block, and which set a loaded model's
layers were packed for. Shared by ``engine_throughput.py`` and ``prefill_formats.py``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from services.common.model_source import ModelSource
from services.engine.core.kernels.loaded import forget_loaded_kernels
from services.engine.core.kernels.native_build import NativeBuildError, selected_isa, supported_isas
from services.engine.core.linear import Linear
from services.engine.core.loaders import LoadedModel, load_model


def clear_kernel_caches() -> None:
    """Forget the loaded kernels, so the next load reads ``TANDEM_CPU_*`` again."""
    forget_loaded_kernels()


@contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """Set ``name`` (and reload the kernels) for the block; restore the previous value after.

    Hold it for a variant's whole measurement: kernels load when each engine is built.
    """
    before = os.environ.get(name)
    os.environ[name] = value
    clear_kernel_caches()
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
        clear_kernel_caches()


def isa_variants(requested: list[str] | None) -> list[str]:
    """Instruction sets to measure, best first: ``TANDEM_CPU_ISA`` alone when set, else the
    supported sets (restricted to ``requested``)."""
    if os.environ.get("TANDEM_CPU_ISA", "").strip():
        try:
            forced = selected_isa()
        except NativeBuildError as exc:  # not a set, or one this CPU lacks
            raise SystemExit(str(exc)) from exc
        if requested and requested != [forced]:
            print(f"TANDEM_CPU_ISA={forced} is set: ignoring --isa {' '.join(requested)}",
                  file=sys.stderr)
        return [forced]
    supported = supported_isas()
    if not requested:
        return supported
    missing = sorted(set(requested) - set(supported))
    if missing:
        raise SystemExit(f"--isa {' '.join(missing)}: this CPU supports only {', '.join(supported)}")
    return [isa for isa in supported if isa in requested]


def kernel_isa(loaded: LoadedModel) -> str:
    """The instruction set of the kernel the model's linear layers were packed for."""
    for module in loaded.model.modules():
        if isinstance(module, Linear) and module.kernel is not None:
            return module.kernel.isa
    return "no native kernel"


@contextmanager
def native_kernels_off() -> Iterator[None]:
    """``TANDEM_CPU_KERNELS=0`` for the block. Hold it while the no-native-kernels row's engines
    are *built*, not only while its model loads: an engine picks the fused element-wise ops and
    the argmax when it is built, and a row whose engines were built with the kernels on ran
    those C ops (the baseline of the tables before 2026-11-23's prefill-attention section)."""
    with environment("TANDEM_CPU_KERNELS", "0"):
        yield


def without_native_kernels(source: ModelSource) -> LoadedModel:
    """The float32 model on the paths ``TANDEM_CPU_KERNELS=0`` gives (torch attention; the split
    ``bmm`` once an engine packs it): load it and build its engines under
    :func:`native_kernels_off`."""
    return load_model(source, torch.float32, attention="torch")
