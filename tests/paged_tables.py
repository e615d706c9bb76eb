"""Block tables for attention tests that build their own paged KV pools."""

from __future__ import annotations


def reversed_tables(context_lens: list[int], block: int) -> list[list[int]]:
    """Per sequence its blocks, reversed (a wrong table shows), from block 1 on."""
    tables, next_id = [], 1
    for n in context_lens:
        need = -(-n // block)
        tables.append(list(range(next_id, next_id + need))[::-1])
        next_id += need
    return tables
