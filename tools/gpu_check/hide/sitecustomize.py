"""A dry run of tools/gpu-check puts this folder first on PYTHONPATH: Python imports it at startup, and every
top-level module named in $SPECEXEC_HIDE_PACKAGES (comma-separated) then fails to import, as it would on the
lent GPU machine's image, which lacks them (tools/gpu_check/image.py). Nothing else changes.

Does not know: which packages are missing (the driver says, through the environment).
"""
from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder

HIDDEN = frozenset(n for n in os.environ.get("SPECEXEC_HIDE_PACKAGES", "").split(",") if n)


class _Hidden(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden: the lent image lacks it)",
                                      name=fullname)
        return None


if HIDDEN:
    sys.meta_path.insert(0, _Hidden())
