"""CPU ranks leave a core to the front end: thread counts derived per node, and the option's bounds."""

from __future__ import annotations

import os

import pytest

from raymoe.actors.process_tuning import rank_cpu_threads
from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError


def test_derived_threads_leave_one_core(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert rank_cpu_threads(None, 1) == 15
    assert rank_cpu_threads(None, 4) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert rank_cpu_threads(None, 1) == 1 and rank_cpu_threads(None, 2) == 1
    assert rank_cpu_threads(6, 2) == 6


def test_cpu_threads_option_is_checked(tiny_model):
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(model=tiny_model, cpu_threads=0)
    assert ei.value.field == "cpu_threads"
