"""Long-lived CPU tensors in transparent huge pages (services/engine/core/kernels/huge_pages.py).

* the arena: tensors start on a cache line, read as zeros when fresh, hold what was copied in,
  never overlap, and a tensor larger than a chunk gets a mapping of its own;
* the system's setting is read as Linux writes it, and ``TANDEM_HUGE_PAGES=0`` turns the arena off;
* where the system gives huge pages on request (``madvise`` or ``always``): the default model's
  kernel tiles and the KV pool lie in mappings the kernel may back with huge pages
  (``THPeligible`` in ``/proc/self/smaps``), and greedy tokens are the same in either kind of page.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.model_source import resolve_model
from services.common.sampling_params import SamplingParams
from services.engine.core.engine import EngineConfig, LLMEngine
from services.engine.core.kernels.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    HugePageArena,
    huge_page_arena,
    return_free_heap,
    thp_mode,
)
from services.engine.core.linear import Linear
from services.engine.core.loaders import load_model

PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356], [1, 4093, 198, 1780, 314, 260, 3575, 282]]


def smaps_field(address: int, field: str) -> int | None:
    """``field`` (kB, or a flag) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    return None


def test_arena_tensors_are_aligned_zero_and_disjoint() -> None:
    arena = HugePageArena(chunk=HUGE_PAGE)
    a = arena.empty((1000, 3), torch.float32)
    b = arena.empty((7,), torch.uint8)
    c = arena.copy(torch.arange(24, dtype=torch.int64).view(2, 3, 4))
    assert all(t.data_ptr() % ALIGN == 0 for t in (a, b, c))
    assert a.is_contiguous() and not a.any()
    assert torch.equal(c, torch.arange(24).view(2, 3, 4))
    a.fill_(1.0)
    b.fill_(255)
    assert torch.equal(c, torch.arange(24).view(2, 3, 4))  # neighbours untouched
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_tensor_larger_than_a_chunk_gets_its_own_mapping() -> None:
    arena = HugePageArena(chunk=HUGE_PAGE)
    small = arena.empty((16,), torch.uint8)
    big = arena.empty((3 * HUGE_PAGE // 4,), torch.float32)  # 3 huge pages of float32
    assert big.numel() == 3 * HUGE_PAGE // 4 and not big[-1]
    assert big.data_ptr() % HUGE_PAGE == 0 and small.data_ptr() % HUGE_PAGE == 0
    assert arena.mapped == 4 * HUGE_PAGE


def test_arena_refuses_bad_chunks_and_device_tensors() -> None:
    with pytest.raises(ValueError):
        HugePageArena(chunk=HUGE_PAGE + 1)
    with pytest.raises(ValueError):
        HugePageArena(chunk=HUGE_PAGE).copy(torch.zeros(2, device="meta"))


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise"
    assert thp_mode(tmp_path / "absent") == ""


def test_huge_pages_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    assert huge_page_arena() is None
    assert return_free_heap() in (True, False)


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no huge pages on request here")
def test_default_model_tiles_and_kv_in_huge_pages_same_tokens(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    tokens = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TANDEM_HUGE_PAGES", setting)
        loaded = load_model(resolve_model("default"), "auto")
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=2, num_blocks=64))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for step in engine.step():
                out.setdefault(step.request_id, []).extend(step.new_token_ids)
        tokens[setting] = out
        if setting == "1":
            packed = [m.packed for m in loaded.model.modules() if isinstance(m, Linear)
                      and m.packed is not None]  # fmt: skip
            assert packed, "the default model has kernel tiles on this machine"
            for tensor in (*packed, engine.kv.data):
                assert smaps_field(tensor.data_ptr(), "THPeligible") == 1
    assert tokens["1"] == tokens["0"]
