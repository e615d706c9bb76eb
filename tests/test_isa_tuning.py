"""A VNNI set runs only where ``tandem tune`` did not find it slower (kernels/isa_tuning.py).

The selection (``native_build.selected_isa``) is tested on a CPU presented with VNNI flags (no
kernel is loaded: the cached choice, the fixed mode, a forced set, a broken cache, a choice made
for another set); the rule on its numbers; the install building both sets a tuned worker may
take. The timing itself runs on real kernels in ``tests/test_int8_decode.py`` (the VNNI build
against its base build: real ``vpdpbusd`` where the CPU has it, emulated elsewhere), and
:func:`isa_tuning.tune` end to end on a VNNI CPU.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from services.engine.core.kernels import isa_tuning, native_build, prebuild
from services.engine.core.kernels.isa_tuning import MARGIN, VnniChoice, choose
from tests.conftest import native_kernel_or_skip

AVX512_VNNI_FLAGS = ("flags\t\t: fpu sse sse2 lm avx2 fma f16c bmi2 movbe avx512f avx512bw "
                     "avx512dq avx512vl avx512_vnni")  # fmt: skip


@pytest.fixture
def vnni_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process sees an AVX-512 VNNI CPU and an empty kernel cache; the choice's cache file."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        pytest.skip("x86 instruction sets")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: AVX512_VNNI_FLAGS)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    for name in ("TANDEM_CPU_ISA", "TANDEM_AUTOTUNE"):
        monkeypatch.delenv(name, raising=False)
    return native_build.vnni_choice_path()


def _cache(vnni: str, chosen: str) -> None:
    isa_tuning.write(VnniChoice(vnni, native_build.vector_isa(vnni), {"decode": 1.0}, chosen, True))


def test_the_flags_decide_until_vnni_is_measured_then_the_measurement(
    vnni_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isa_tuning.vnni_pair() == ("avx512vnni", "avx512")
    assert not vnni_cpu.exists() and native_build.selected_isa() == "avx512vnni"
    _cache("avx512vnni", "avx512")  # measured no faster
    assert vnni_cpu.is_file() and native_build.selected_isa() == "avx512"
    monkeypatch.setenv("TANDEM_AUTOTUNE", "fixed")  # replicas everywhere alike: the flags only
    assert native_build.selected_isa() == "avx512vnni"
    monkeypatch.delenv("TANDEM_AUTOTUNE")
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx512vnni")  # forced wins over the measurement
    assert native_build.selected_isa() == "avx512vnni"
    monkeypatch.delenv("TANDEM_CPU_ISA")
    _cache("avx512vnni", "avx512vnni")  # measured faster
    assert native_build.selected_isa() == "avx512vnni"


@pytest.mark.parametrize(
    "content",
    [
        '{"vnni": "avxvnni", "chosen": "avx2"}',  # measured on another set (not this CPU's best)
        '{"vnni": "avx512vnni", "chosen": "avx2"}',  # not the VNNI set's base: other bits
        '{"vnni": "avx512vnni", "chosen": "generic"}',
        '{"vnni": "avx512vnni"}',
        '["avx512"]',
        "not json",
    ],
)
def test_a_cached_choice_it_cannot_take_leaves_the_flags_to_decide(vnni_cpu: Path, content: str) -> None:
    vnni_cpu.parent.mkdir(parents=True, exist_ok=True)
    vnni_cpu.write_text(content)
    assert native_build.selected_isa() == "avx512vnni"


def test_no_choice_between_vector_widths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CPU without VNNI: nothing to time, and a stray cached choice changes nothing (AVX-512
    against AVX2 would change the bits, not only the speed)."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        pytest.skip("x86 instruction sets")
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: AVX512_VNNI_FLAGS.replace(" avx512_vnni", ""))
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    _cache("avx512vnni", "avx512")
    native_build.vnni_choice_path().write_text('{"vnni": "avx512", "chosen": "avx2"}')
    assert isa_tuning.vnni_pair() is None
    assert native_build.selected_isa() == "avx512"
    assert isa_tuning.tune() is None  # nothing loaded, nothing timed
    assert native_build.measured_vnni_choice("avx512") is None


def test_the_rule_takes_vnni_only_when_faster_and_nowhere_slower() -> None:
    win, tie, lose = 1 + 2 * MARGIN, 1.0, 1 - 2 * MARGIN
    assert choose({"decode": tie, "prefill": win}, "avx512vnni", "avx512") == "avx512vnni"
    assert choose({"decode": win, "prefill": win}, "avx512vnni", "avx512") == "avx512vnni"
    assert choose({"decode": tie, "prefill": tie}, "avx512vnni", "avx512") == "avx512"  # a tie
    assert choose({"decode": lose, "prefill": win}, "avx512vnni", "avx512") == "avx512"
    assert choose({"decode": 1 + MARGIN / 2, "prefill": tie}, "avxvnni", "avx2") == "avx2"


def test_an_install_builds_the_vnni_set_and_its_base(
    vnni_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So a worker that takes either after `tandem tune` finds it prebuilt (no compile at start)."""
    assert prebuild.target_isas(this_cpu=True) == ("avx512vnni", "avx512")
    _cache("avx512vnni", "avx512")
    assert prebuild.target_isas(this_cpu=True) == ("avx512vnni", "avx512")
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    assert prebuild.target_isas(this_cpu=True) == ("avx2",)


def test_tune_on_a_vnni_cpu_caches_what_the_workers_then_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_kernel_or_skip()
    if isa_tuning.vnni_pair() is None:
        pytest.skip("this CPU has no VNNI set: tune() times nothing (test_no_choice_between_vector_widths)")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    choice = isa_tuning.tune(rounds=3, read_bytes=32 << 20)
    assert choice is not None and set(choice.speedup) == {"decode", "prefill"}
    assert choice.chosen == choose(choice.speedup, choice.vnni, choice.base)
    if choice.cached:
        assert native_build.selected_isa() == choice.chosen
