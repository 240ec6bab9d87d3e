"""A drafter: one decoder layer that drafts from the target's hidden states (EAGLE-3 heads, MTP layers).

A drafter row pairs a token with a state that comes before it: row t holds token x_{t+1} and the state at
position t, and predicts x_{t+2}. For committed tokens that state is the TARGET's (its verification or prefill
pass computed it); deeper in a tree it is the drafter's own output at the parent node, so the drafter is applied
recursively, one tree level per pass (as EAGLE and MTP speculators run). Rows attend to each other through the
drafter's own small KV cache (one layer), at the position of the state they read.

Two input styles, each as its checkpoints were trained, each its own class:
- Eagle3Drafter (EAGLE-3, Li et al. 2025, arXiv 2503.01840): the target's states of a few layers (`taps`, low/mid/high;
  tap j = the residual stream entering target layer j) are fused by `fuse` (fc: k*D_t -> D) once, when they come
  in. The layer's attention reads [input_layernorm(embedding); hidden_norm(state)] (2D wide), its residual is the
  state itself (or the normed state with norm_before_residual); the state handed on is the layer's output before
  the final norm; logits = lm_head(norm(state)) over the head's own vocabulary, mapped to the target's
  (`d2t`: target id = draft id + d2t[draft id]; every other target token -inf).
- MtpDrafter (DeepSeek-V3 next-n layers, GLM-4.5, Qwen3.5 / Qwen3-Next `mtp.*`): u = proj([enorm(embedding);
  hnorm(state)]), then one decoder layer of the model's own kind, then the final norm; the state is that normed
  output (the target's is its normed output too), logits = the LM head (the target's, shared). With
  `mask_first` (DeepSeek's rule) the row at position 0 sees a zero embedding.

A third, Gemma 4's assistant, is specexec/network/assistant.py. `forward(tokens, positions, mask, cache, slots,
states)` -> the states handed on [B, T, D]; `logits(states)` like any model's. `taps` says which target layers the drafter reads (empty: the target's final normed output).

Does not know: checkpoints (specexec/drafters/ reads them), trees, which target it serves beyond the states it
is handed, the engine (specexec/builders/growth.py feeds it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.attention import TreeMask
from specexec.network.model import Transformer, on_meta, soft_cap
from specexec.network.norms import RMSNorm
from specexec.network.self_attention import Attention

@dataclass(frozen=True)
class DrafterShape:
    """What a drafter is beyond its decoder layer's ModelArgs and its style (its class): the target's hidden size,
    the target layers it reads (sorted; empty: the target's final output), its own vocabulary (None: the
    target's), and the styles' options (norm_before_residual: EAGLE-3's; mask_first: MTP's)."""

    target_dim: int
    taps: tuple[int, ...] = ()
    draft_vocab: int | None = None
    norm_before_residual: bool = False
    mask_first: bool = False

    def __post_init__(self) -> None:
        if list(self.taps) != sorted(set(self.taps)):
            raise ValueError(f"drafter taps must be distinct and ascending, got {self.taps}")


class Drafter(Transformer):
    """A network drafting from the target's states (module docstring): what every style shares. A style is a
    subclass: its modules (built in __init__ after this one's), its layer pass (`_draft`) and the norm before its
    head (`_head_norm`). `embed_tokens` and `lm_head` may be the target's modules (shared: `share`)."""

    reads_target = True

    def __init__(self, args: ModelArgs, shape: DrafterShape) -> None:
        super().__init__(args)
        self.shape, self.taps = shape, shape.taps

    @classmethod
    def build(cls, args: ModelArgs, shape: DrafterShape) -> Drafter:
        """One of this style on the meta device (nothing allocated): its weights are loaded with assign=True next."""
        with on_meta():
            return cls(args, shape)

    @property
    def dim(self) -> int:
        return self.args.dim

    def share(self, target: Transformer, embed: bool = True, head: bool = False) -> None:
        """Use the target's embedding module (embed) and its LM head (head: its lm_head module, or its embedding
        when the target ties them; the drafter's own head goes)."""
        if embed:
            self.embed_tokens = target.embed_tokens
        if head:
            t_head = target._modules.get("lm_head")
            if t_head is not None:
                self.lm_head = t_head
            else:
                self._modules.pop("lm_head", None)
                self.embed_tokens = target.embed_tokens

    def attend_to(self, cache: KVCache) -> None:
        """The target's cache, for a drafter that attends to the target's K/V (this one keeps its own: no-op)."""

    def read_target(self, hidden: torch.Tensor, tapped: list[torch.Tensor] | None) -> torch.Tensor:
        """The target's states of some rows -> the drafter's input states [R, D]: hidden [R, D_t] (the target's
        final normed output) or the taps' rows (each [R, D_t], ascending layers) fused."""
        if not self.taps:
            return hidden
        if tapped is None or len(tapped) != len(self.taps):
            raise RuntimeError(f"the drafter reads target layers {self.taps}; the target pass recorded "
                               f"{0 if tapped is None else len(tapped)} of them")
        return self.fuse(torch.cat(tapped, dim=-1).to(self.fuse.weight.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: TreeMask | torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                states: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions [B, T]; states [B, T, D]: the state before each token (read_target's, or this
        drafter's own output at the parent). mask/cache/slots as Transformer.forward. -> states [B, T, D]."""
        if states is None:
            raise ValueError("a drafter drafts from states: pass each row's state before its token")
        if cache is not None and slots is None:
            slots = torch.arange(cache.length, cache.length + tokens.shape[1], device=tokens.device)
        emb = self.embed(tokens)
        states = states.to(emb.dtype)
        if cache is not None:
            cache.begin_forward()
        cos, sin = self.rope(positions, emb.dtype)
        plan = self.attention_plan(mask, positions, emb.dtype)
        return self._draft(emb, states, positions, cos, sin, plan, cache, slots)

    def _draft(self, emb: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, plan, cache: KVCache | None, slots: torch.Tensor | None) -> torch.Tensor:
        """The style's pass: embeddings and states [B, T, D] -> the states handed on [B, T, D]."""
        raise NotImplementedError

    def _head_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before the head of a style whose handed-on state is not normed already (identity here)."""
        return h

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """states [..., D] -> fp32 logits over the TARGET's vocabulary [R, V] (a head of its own vocabulary:
        its tokens mapped through d2t, the rest -inf)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            h = h.index_select(0, rows)
        h = self._head_norm(h)
        head = self._modules.get("lm_head")
        logits = soft_cap((F.linear(h, self.embed_tokens.weight) if head is None else head(h)).float(),
                          self.args.logit_softcap)
        if "d2t" not in self._buffers:
            return logits
        full = logits.new_full((logits.shape[0], self.args.vocab_size), float("-inf"))
        ids = torch.arange(logits.shape[1], device=logits.device) + self.d2t
        return full.index_copy_(1, ids, logits)


class Eagle3Drafter(Drafter):
    """EAGLE-3's style (module docstring): one decoder layer whose attention reads [embedding; state] (2D wide),
    the taps fused by `fuse`, a head over its own vocabulary mapped through `d2t`."""

    def __init__(self, args: ModelArgs, shape: DrafterShape) -> None:
        super().__init__(replace(args, n_layers=1, layer_types=args.layer_types[:1]), shape)
        d = args.dim
        block = self.layers[0]                               # its attention reads [embedding; state]
        setattr(block, block.mixer_attribute, Attention(self.args, 0, in_dim=2 * d))
        self.layers[0].hidden_norm = RMSNorm(d, args.norm_eps, args.norm_plus_one)
        if shape.taps:
            self.fuse = nn.Linear(len(shape.taps) * shape.target_dim, d, bias=False)
        if shape.draft_vocab is not None:
            self.lm_head = nn.Linear(d, shape.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(shape.draft_vocab, dtype=torch.long))

    def _draft(self, emb, states, positions, cos, sin, plan, cache, slots):
        block = self.layers[0]
        normed = block.hidden_norm(states)
        h = block.mixer(torch.cat([block.input_layernorm(emb), normed], dim=-1), cos, sin, plan, cache, 0, slots)
        x = (normed if self.shape.norm_before_residual else states) + h
        return x + block.mlp(block.post_attention_layernorm(x))

    def _head_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class MtpDrafter(Drafter):
    """MTP's style (module docstring): proj([enorm(embedding); hnorm(state)]), one decoder layer of the model's
    own kind, the final norm; the target's head."""

    def __init__(self, args: ModelArgs, shape: DrafterShape) -> None:
        super().__init__(replace(args, n_layers=1, layer_types=args.layer_types[:1]), shape)
        d = args.dim
        self.enorm = RMSNorm(d, args.norm_eps, args.norm_plus_one)
        self.hnorm = RMSNorm(d, args.norm_eps, args.norm_plus_one)
        self.proj = nn.Linear(2 * d, d, bias=False)

    def _draft(self, emb, states, positions, cos, sin, plan, cache, slots):
        if self.shape.mask_first:
            emb = emb.masked_fill((positions == 0)[..., None], 0.0)
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(states)], dim=-1))
        return self.norm(self.layers[0](x, cos, sin, plan, cache, 0, slots))
