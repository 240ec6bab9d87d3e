"""Gemma 4's assistant drafter (Gemma4AssistantForCausalLM): a few Gemma 4 decoder layers that own no K/V and
attend to the TARGET's, applied recursively one tree level per pass.

A row pairs a token with the target's state before it (as every drafter's row does, specexec/network/drafter.py):
its input is pre_projection([the target's embedding of the token; that state]) (2 D_t -> D). Every layer's
queries (q_proj, q_norm, the layer kind's RoPE) read the K/V rows the target's cache holds for the last
non-sharing layer of the same kind (full attention: every committed row; a sliding layer: the last window + 1
of them, as transformers masks them), with unscaled scores; each layer is Gemma 4's (norms around attention and
the MLP, a scalar per layer).
Every row sits at the position of the tree's root (the next token to commit), as transformers runs it: deeper
levels change the state and the token, never the position nor what is attended to. The final norm's output h
gives the logits (the assistant's own tied head; with ordered embeddings only the tokens of the top
`centroid_intermediate_top_k` centroids get a logit, every other token the smallest of those less one), and
post_projection(h) [D_t] is the state handed to the next level.

The state a row hands on is [post_projection(h); h] (D_t + D wide): the next level reads its first part, the
logits its second. The target's state enters as [state; 0] (read_target).

Does not know: checkpoints (specexec/drafters/assistant.py), trees, which rows the target committed beyond its
cache's length (the engine hands the cache over: `attend_to`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.drafter import Drafter, DrafterShape
from specexec.network.model import Transformer, on_meta
from specexec.network.rope import apply_rope


GATHER_BYTES = 256 << 20       # the centroid head's gathered embedding rows [rows, k * per, D] per step, at most


def gather_rows(picked: int, dim: int, elem: int) -> int:
    """Rows of the centroid head computed together so that their gathered rows [rows, picked, dim] (elem bytes)
    stay within GATHER_BYTES (at least 1 row)."""
    return max(1, GATHER_BYTES // max(1, picked * dim * elem))


class Assistant(Drafter):
    """`args`: the assistant's decoder (its own width D, layer kinds, heads); `shape.target_dim`: D_t;
    `sources` {layer kind's window (None: full): the target layer whose K/V that kind reads}; `centroids`:
    (number, top k) of the ordered-embedding head, None for the plain tied head."""

    def __init__(self, args: ModelArgs, shape: DrafterShape, sources: dict[int | None, int],
                 centroids: tuple[int, int] | None = None) -> None:
        super().__init__(args, shape)                      # its own n_layers: every layer of its decoder
        self.sources = dict(sources)
        for block in self.layers:                          # no K/V of its own: the target's are read
            for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                block.self_attn._modules.pop(name, None)
        self._modules.pop("lm_head", None)                 # tied to its embedding
        self.pre_projection = nn.Linear(2 * shape.target_dim, args.dim, bias=False)
        self.post_projection = nn.Linear(args.dim, shape.target_dim, bias=False)
        self.centroids = None
        if centroids is not None:
            n, self.top_k = centroids
            self.centroids = nn.Linear(args.dim, n, bias=False)
            self.register_buffer("token_ordering", torch.zeros(args.vocab_size, dtype=torch.long))
        self.target_cache: KVCache | None = None
        self.target_embed: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def dim(self) -> int:
        return self.shape.target_dim + self.args.dim

    def share(self, target: Transformer, embed: bool = True, head: bool = False) -> None:
        """Its input embeds tokens with the target's embedding (scaled as the target scales it)."""
        self.target_embed = target.embed

    def attend_to(self, cache: KVCache) -> None:
        """The target's cache whose committed rows every pass attends to."""
        self.target_cache = cache

    def read_target(self, hidden: torch.Tensor, tapped: list[torch.Tensor] | None) -> torch.Tensor:
        """The target's normed output rows [R, D_t] -> [R, D_t + D] (the second part unused)."""
        return torch.cat([hidden, hidden.new_zeros(hidden.shape[0], self.args.dim)], dim=-1)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask=None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None, states: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] and states [B, T, D_t + D] (the state before each token) -> [B, T, D_t + D]. The
        positions, mask, cache and slots of a drafter's pass are not read: every row sits at the root's position
        (the target cache's length) and attends to the target's committed rows only."""
        if states is None or self.target_cache is None or self.target_embed is None:
            raise ValueError("the assistant drafts from the target's states and cache: share, attend_to, states")
        t_dim = self.shape.target_dim
        x = self.pre_projection(torch.cat([self.target_embed(tokens), states[..., :t_dim].to(tokens.device)],
                                          dim=-1).to(self.pre_projection.weight.dtype))
        n = self.target_cache.length
        pos = torch.full_like(tokens, n)
        for i, block in enumerate(self.layers):
            kind = self.args.layer_kind(i)
            cos, sin = self.rope(pos, x.dtype, kind.rope)
            x = self._layer(block, x, cos, sin, *self._target_rows(kind.window, n))
        h = self.norm(x)
        return torch.cat([self.post_projection(h), h], dim=-1)

    def _target_rows(self, window: int | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's K, V rows [B, H_kv, n', hd] a layer of this kind reads: of the n committed rows of its
        source layer all (window None) or the last window + 1 (transformers' bidirectional sliding mask over
        the shared K/V: |query - key| <= window, the key axis flipped to look back)."""
        k, v = self.target_cache.view(self.sources[window], n)
        if window is not None and n > window + 1:
            k, v = k[:, :, n - window - 1:], v[:, :, n - window - 1:]
        return k, v

    @staticmethod
    def _layer(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """One Gemma 4 decoder layer whose queries attend to k, v [B, H_kv, S, hd] (none: no attention)."""
        attn = block.self_attn
        B, T, _ = x.shape
        q = attn.q_norm(attn.q_proj(block.input_layernorm(x)).view(B, T, attn.n_heads, attn.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        # No mask: the queries folded per KV head [B, H_kv, G*T, hd], as attend() does (enable_gqa has no fused
        # CUDA kernel at head size 512: the math one repeats K/V per query head and builds H x T x S scores).
        if k.shape[2]:
            qf = q.reshape(B, k.shape[1], -1, attn.head_dim)
            out = F.scaled_dot_product_attention(qf, k.to(q.dtype), v.to(q.dtype), scale=1.0)
            out = out.reshape(B, attn.n_heads, T, attn.head_dim)
        else:
            out = torch.zeros_like(q)
        x = x + block.post_attention_layernorm(attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))
        x = x + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))
        return x * block.layer_scalar

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """states [..., D_t + D] -> fp32 logits [R, V] from their second part."""
        h = hidden.reshape(-1, hidden.shape[-1])[:, self.shape.target_dim:]
        if rows is not None:
            h = h.index_select(0, rows)
        w = self.embed_tokens.weight
        if self.centroids is None:
            return F.linear(h, w).float()
        per = self.args.vocab_size // self.centroids.out_features
        top = self.centroids(h).topk(self.top_k, dim=-1).indices                    # [R, k]
        ids = self.token_ordering.view(-1, per)[top].reshape(h.shape[0], -1)        # [R, k * per]
        step = gather_rows(ids.shape[1], w.shape[1], w.element_size())
        picked = torch.cat([(h[i:i + step, None] @ w[ids[i:i + step]].transpose(1, 2))[:, 0]
                            for i in range(0, h.shape[0], step)])                   # [R, k * per]
        floor = picked.amin() - 1.0                        # on the device: no host sync per draft pass
        out = floor.expand(h.shape[0], self.args.vocab_size).clone()
        return out.scatter_(1, ids, picked).float()

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache:
        """Rows of its own: none (a cache of no layers that only counts)."""
        w = self.pre_projection.weight
        return KVCache(0, 1, 1, capacity, w.dtype, w.device)


def build_assistant(args: ModelArgs, shape: DrafterShape, sources: dict[int | None, int],
                    centroids: tuple[int, int] | None) -> Assistant:
    """An Assistant on the meta device (its weights are loaded with assign=True next)."""
    with on_meta():
        return Assistant(args, shape, sources, centroids)
