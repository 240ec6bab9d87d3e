"""Where specexec keeps what it builds on this machine (layer caches, compiled CPU kernels, tuning data): one
root directory. It lives in the bottom layer so that the kernels' builder (build.py) and everything above it
(offload's layer cache, specexec's tuning store, the CLI) name the same root.

Does not know: what lives under the root (each user names its own subfolder).
"""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """$SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec."""
    if os.environ.get("SPECEXEC_CACHE"):
        return Path(os.environ["SPECEXEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specexec"
