"""Host allocator tuning of CPU ranks (``raymoe.platform.cpu.host_alloc``): freed blocks are reused, so a step that
allocates and frees the same megabyte tensors touches no fresh pages once warm."""

from __future__ import annotations

import resource

import pytest
import torch

from raymoe.platform.cpu import host_alloc


def _minor_faults() -> int:
    """Minor page faults of this thread only: other threads of the test process (Ray's, torch's pools) fault
    pages of their own at any time, which made a process-wide count flaky in the full suite."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _step(nbytes: int) -> None:
    """What a decode layer does to the heap: a few same-sized buffers live at once, written, then freed."""
    bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(3)]
    for b in bufs:
        b.fill_(1)
    del bufs


def test_tuned_heap_reuses_megabyte_buffers_without_page_faults():
    if not host_alloc.tune_host_allocator():
        pytest.skip("not glibc (or disabled): the allocator keeps its defaults")
    assert host_alloc.tune_host_allocator()  # idempotent: the first answer
    nbytes = 4 << 20
    for _ in range(3):  # warm-up: the heap grows to the step's high-water mark once
        _step(nbytes)
    before = _minor_faults()
    for _ in range(20):
        _step(nbytes)
    # untuned glibc trims the heap top between steps: about 1,000 faults over these 20 steps here, tuned none
    assert _minor_faults() - before < 200


def test_tuning_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(host_alloc, "_done", None)
    monkeypatch.setenv("RAYMOE_HOST_MALLOC_TUNING", "0")
    assert host_alloc.tune_host_allocator() is False
    monkeypatch.setattr(host_alloc, "_done", None)  # let the next caller decide afresh (the setting is kept)
