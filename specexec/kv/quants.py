"""The formats a KV cache may store its rows in (--kv-quant): the names only, so a configuration can check the
flag without importing torch. "int8" is LOSSY and opt-in (specexec/kv/rows.py implements it).

Does not know: how rows are stored or quantized (rows.py), caches, models.
"""
from __future__ import annotations

QUANTS = ("none", "int8")
