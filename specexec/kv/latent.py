"""The cache of latent attention layers (specexec/network/latent.py): per slot and layer ONE row of kv_rank +
rope_dim values (the normed latent and the rotated shared key), read back as both the key and the value of one
KV head. It is KVCache's row store with one part per row instead of two (specexec/kv/rows.py), so everything
rows do works on it unchanged: a tree pass writes each node's row at its slot and the mask shows each node its
ancestors' rows only; `keep(slots)` gathers the accepted rows (no weights needed); streamed layers move only
committed rows with their layer (specexec/kv/stream.py).

DeepSeek-V3 (61 layers, kv_rank 512, rope_dim 64) in bf16: 576 x 2 bytes x 61 = 70,272 bytes per token, where
its 128 heads of plain attention (keys 192, values 128 per head) would cache 128 x 320 x 2 x 61 = 4,997,120.

Does not know: the maths that fills the rows, which layers stream (the plan says), trees.
"""
from __future__ import annotations

from specexec.config import ModelArgs
from specexec.kv.rows import row_bytes

PARTS = 1          # one row per slot serves as key and value


def latent_row_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none") -> int:
    """Bytes of `slots` slots of one latent attention layer's cache (int8: plus its per-row scale)."""
    m = args.latent
    return slots * row_bytes(1, m.kv_rank + m.rope_dim, elem, quant, parts=PARTS)


def plain_row_bytes(args: ModelArgs, slots: int, elem: int) -> int:
    """What the same layer would cache per `slots` slots as plain attention of n_heads heads: keys of nope_dim +
    rope_dim and values of v_dim per head (for the comparison in `specexec plan`)."""
    m = args.latent
    return slots * args.n_heads * (m.nope_dim + m.rope_dim + m.v_dim) * elem
