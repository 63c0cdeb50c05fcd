"""Where raymoe keeps files it builds (the demo checkpoint, compiled kernels, benchmark models); imports no other
raymoe module, so any layer may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RAYMOE_CACHE_DIR`` if set, else ``~/.cache/raymoe`` (the folder may not exist yet)."""
    env = os.environ.get("RAYMOE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "raymoe"
