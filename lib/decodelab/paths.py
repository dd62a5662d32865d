"""Where the package keeps its files: shipped data (tiny models, drafter, corpus) and the user cache."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DATA = Path(__file__).parent / "data"


def cache_dir() -> Path:
    """$DECODELAB_CACHE, else $XDG_CACHE_HOME/decodelab, else ~/.cache/decodelab."""
    if os.environ.get("DECODELAB_CACHE"):
        return Path(os.environ["DECODELAB_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "decodelab"
