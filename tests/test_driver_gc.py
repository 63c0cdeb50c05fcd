"""The serving driver's garbage-collector policy (``raymoe.actors.process_tuning.configure_driver_gc``), applied in
a child process so that this one's collector is left as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import raymoe

CHILD = """
import gc
from raymoe.actors.process_tuning import DRIVER_GC_GEN0_THRESHOLD, configure_driver_gc
before = gc.get_threshold()
frozen = configure_driver_gc()
assert frozen == gc.get_freeze_count() > 0, frozen
assert gc.get_threshold() == (DRIVER_GC_GEN0_THRESHOLD,) + before[1:], gc.get_threshold()
assert DRIVER_GC_GEN0_THRESHOLD > before[0]
print("ok")
"""


def test_the_driver_freezes_its_start_up_heap_and_raises_the_young_threshold():
    root = str(Path(raymoe.__file__).resolve().parent.parent)  # this checkout's package, in the child too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
