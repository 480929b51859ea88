"""An engine worker's memory report reads the truth of its own process: pages of a tensor count
as resident only once touched, views of one storage count once, and glibc's in-use heap grows
by what is allocated."""

from __future__ import annotations

import mmap

import pytest

torch = pytest.importorskip("torch")

from worker.memory import PAGE_BYTES, _merged, engine_memory, malloc_stats, resident_bytes  # noqa: E402

MB = 1 << 20


def _edge_bytes() -> int:
    """What one touched edge of a fresh mapping makes resident: a page, or a huge page where the
    kernel backs anonymous memory with transparent huge pages unasked (``always``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            always = "[always]" in f.read()
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            huge = int(f.read())
    except (OSError, ValueError):
        return PAGE_BYTES
    return huge if always else PAGE_BYTES


EDGE = _edge_bytes()


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def test_a_tensor_s_pages_are_resident_only_once_touched():
    # A fresh anonymous mapping seen as a tensor: malloc may hand even a 64 MB tensor memory
    # its process touched before (in a long test session, 3.75 huge pages of a freed heap were
    # resident in one that was never written).
    buffer = mmap.mmap(-1, 64 * MB)
    t = torch.frombuffer(buffer, dtype=torch.uint8)
    assert resident_bytes([span(t)]) == 0
    t[: 16 * MB].fill_(1)
    assert 16 * MB <= resident_bytes([span(t)]) <= 16 * MB + EDGE  # a huge page past the edge
    t.fill_(1)
    assert resident_bytes([span(t)]) >= 64 * MB


def test_views_of_one_storage_count_once_and_disjoint_spans_add():
    assert _merged([(100, 50), (120, 10), (0, 10), (140, 20)]) == [(0, 10), (100, 60)]
    t = torch.ones(8 * MB, dtype=torch.uint8)
    u = torch.ones(4 * MB, dtype=torch.uint8)
    one = resident_bytes([span(t)])
    assert resident_bytes([span(t), span(t[MB:])]) == one
    assert resident_bytes([span(t), span(u)]) == one + resident_bytes([span(u)])


def test_the_report_counts_the_kv_cache_and_the_heap_in_use():
    before, _ = malloc_stats()
    kv = torch.ones(32 * MB, dtype=torch.uint8)
    after, _ = malloc_stats()
    assert after - before >= 32 * MB
    report = engine_memory([span(kv)])
    assert report.kv_cache_mb == 32.0 and report.kv_cache_resident_mb >= 32.0
    assert report.rss_mb >= report.kv_cache_resident_mb
    assert report.python_objects > 0 and report.python_blocks > 0
