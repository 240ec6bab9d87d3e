"""llama.cpp's tensor names -> the Hugging Face Hub names of the same tensors, per GGUF architecture.

A dense decoder's names map one to one (token_embd -> model.embed_tokens, blk.N.attn_q -> model.layers.N.
self_attn.q_proj, ..., output -> lm_head). A mixture of experts stores its routed experts MERGED, one tensor
per projection and layer (blk.N.ffn_{gate,up,down}_exps [E, out, in], expert outermost): each becomes the E
per-expert Hub names of its family (Qwen3-MoE: mlp.experts.e.{gate,up,down}_proj; Mixtral, a "llama" file
with an expert count: block_sparse_moe.experts.e.{w1,w3,w2}), each read as its own slice of the file
(`Piece.expert`); the router blk.N.ffn_gate_inp is the family's gate. Old Mixtral files that store experts
one by one (blk.N.ffn_gate.E) map the same way. Any other expert layout (fused gate+up, shared experts, ...)
maps to nothing, and the reader refuses the tensor by name.

Does not know: reading bytes (gguf.py), ModelArgs or what the Hub names mean to the network (specexec's family
weight mapping takes over from the Hub names).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
# GGUF architecture -> (router name, {merged expert tensor: per-expert Hub name with {e}}) inside a layer
EXPERT_NAMES = {
    "qwen3moe": ("mlp.gate", {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                              "ffn_down_exps": "mlp.experts.{e}.down_proj"}),
    "llama": ("block_sparse_moe.gate", {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                                        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                                        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}),
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SPLIT_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")   # old Mixtral files


@dataclass(frozen=True)
class Piece:
    """A Hub-named tensor's place in the file: the GGUF tensor, and the expert it is of a merged one (None:
    the whole tensor)."""

    gguf: str
    expert: int | None = None


def hub_names(gguf_name: str, arch: str, n_experts: int) -> dict[str, Piece] | None:
    """The Hub tensor name(s) a GGUF tensor holds (a merged expert tensor holds n_experts of them), or None when
    it is no tensor of the dense decoder or of `arch`'s experts (n_experts 0: a dense file)."""
    if gguf_name in GLOBAL_NAMES:
        return {GLOBAL_NAMES[gguf_name]: Piece(gguf_name)}
    split = _SPLIT_EXPERT.match(gguf_name)
    if split is not None:
        if not n_experts or arch != "llama":
            return None
        layer, proj, e = split.groups()
        merged = EXPERT_NAMES[arch][1][f"{proj}_exps"]
        return {f"model.layers.{layer}.{merged.format(e=e)}.weight": Piece(gguf_name)}
    m = _BLOCK.match(gguf_name)
    if m is None:
        return None
    layer, kind, suffix = m.groups()
    head = f"model.layers.{layer}."
    if kind in BLOCK_NAMES:
        return {f"{head}{BLOCK_NAMES[kind]}.{suffix}": Piece(gguf_name)}
    if not n_experts or arch not in EXPERT_NAMES or suffix != "weight":
        return None
    router, merged = EXPERT_NAMES[arch]
    if kind == "ffn_gate_inp":
        return {f"{head}{router}.weight": Piece(gguf_name)}
    if kind in merged:
        return {f"{head}{merged[kind].format(e=e)}.weight": Piece(gguf_name, e) for e in range(n_experts)}
    return None
