"""Tiny random drafters written in their published checkpoint layouts (a helper of tests/drafters/test_drafters.py):
an EAGLE-3 head as the EAGLE repository and vLLM read it (config.json with draft_vocab_size and
eagle_config.eagle_aux_hidden_state_layer_ids; midlayer.*, fc, norm, lm_head, d2t, t2d, optionally
embed_tokens), and a plain-torch reference of what such a head computes, written from the published description
(EAGLE-3, arXiv 2503.01840; the EAGLE repository's model), independent of specexec's network.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

STD = 0.2


def write_eagle3(dest: Path, target_dim: int = 64, vocab: int = 320, draft_vocab: int = 200, taps=(0, 2, 4),
                 dim: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 128,
                 own_embed: bool = False, seed: int = 0, speculators: bool = False, materialize: bool = True,
                 **extra) -> Path:
    """An EAGLE-3 head reading `taps` of a target of hidden size target_dim and vocabulary `vocab`, its own
    head over `draft_vocab` tokens (a random sorted subset of the target's, always including the first 8).
    materialize=False: config.json only (what `specexec plan` reads)."""
    dest.mkdir(parents=True, exist_ok=True)
    if materialize:
        _eagle3_tensors(dest, target_dim, vocab, draft_vocab, len(taps), dim, heads, kv_heads, head_dim, inter,
                        own_embed, seed, speculators)
    layer_cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=dim,
                     intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=head_dim, num_hidden_layers=1, vocab_size=vocab, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=256, hidden_act="silu", tie_word_embeddings=False)
    eagle = dict(draft_vocab_size=draft_vocab, target_hidden_size=target_dim)
    if speculators:
        cfg = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                   transformer_layer_config=layer_cfg, eagle_aux_hidden_state_layer_ids=list(taps), **eagle)
    else:
        cfg = dict(layer_cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps),
                                            "use_aux_hidden_state": True}, **eagle)
    cfg.update(extra)
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


def _eagle3_tensors(dest: Path, target_dim: int, vocab: int, draft_vocab: int, n_taps: int, dim: int, heads: int,
                    kv_heads: int, head_dim: int, inter: int, own_embed: bool, seed: int, speculators: bool) -> None:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * STD * scale

    def norm_w() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    layer = {
        "self_attn.q_proj.weight": rnd(heads * head_dim, 2 * dim), "self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * dim),
        "self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * dim), "self_attn.o_proj.weight": rnd(dim, heads * head_dim),
        "mlp.gate_proj.weight": rnd(inter, dim), "mlp.up_proj.weight": rnd(inter, dim),
        "mlp.down_proj.weight": rnd(dim, inter), "input_layernorm.weight": norm_w(),
        "hidden_norm.weight": norm_w(), "post_attention_layernorm.weight": norm_w(),
    }
    prefix = "layers.0." if speculators else "midlayer."
    tensors = {prefix + k: v for k, v in layer.items()}
    keep = torch.cat([torch.arange(8), 8 + torch.randperm(vocab - 8, generator=g)[: draft_vocab - 8].sort().values])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    tensors |= {"fc.weight": rnd(dim, n_taps * target_dim, scale=1 / math.sqrt(n_taps)), "norm.weight": norm_w(),
                "lm_head.weight": rnd(draft_vocab, dim, scale=2.5), "d2t": keep - torch.arange(draft_vocab),
                "t2d": t2d}
    if own_embed:
        tensors["embed_tokens.weight"] = rnd(vocab, dim, scale=5.0)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [H, T, d], rotate-half RoPE at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def eagle3_reference(path: Path, embed: torch.Tensor, tokens: torch.Tensor, taps: list[torch.Tensor],
                     heads: int = 4, kv_heads: int = 2) -> torch.Tensor:
    """What the head at `path` computes for one causal sequence, in plain torch: tokens [T] (token t+1 of the
    text), taps: the target's states at positions 0..T-1 (each [T, D_t], the low/mid/high layers' inputs), embed
    the embedding table. -> logits over the TARGET vocabulary [T, V] (-inf outside the head's)."""
    from safetensors.torch import load_file
    w = load_file(str(path / "model.safetensors"))
    L = {k.removeprefix("midlayer.").removeprefix("layers.0."): v for k, v in w.items()}
    T = tokens.numel()
    h = torch.cat(taps, -1) @ w["fc.weight"].T                                 # the fused state [T, D]
    x = torch.cat([_rms(embed[tokens], L["input_layernorm.weight"]), _rms(h, L["hidden_norm.weight"])], -1)
    q = (x @ L["self_attn.q_proj.weight"].T).view(T, heads, -1).transpose(0, 1)
    k = (x @ L["self_attn.k_proj.weight"].T).view(T, kv_heads, -1).transpose(0, 1)
    v = (x @ L["self_attn.v_proj.weight"].T).view(T, kv_heads, -1).transpose(0, 1)
    pos = torch.arange(T)
    q, k = _rope(q, pos), _rope(k, pos)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    a = (s @ v).transpose(0, 1).reshape(T, -1) @ L["self_attn.o_proj.weight"].T
    y = h + a
    m = _rms(y, L["post_attention_layernorm.weight"])
    y = y + (torch.nn.functional.silu(m @ L["mlp.gate_proj.weight"].T) * (m @ L["mlp.up_proj.weight"].T)) @ L["mlp.down_proj.weight"].T
    logits = _rms(y, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((T, w["t2d"].numel()), float("-inf"))
    full[:, torch.arange(w["d2t"].numel()) + w["d2t"]] = logits
    return full


def write_nextn(src: Path, dest: Path, seed: int = 0, copy_of: int | None = None) -> Path:
    """A copy of the checkpoint at `src` (a next-n family: GLM-4.5, DeepSeek-V3) with its MTP layer stored as
    published: layer N = num_hidden_layers of the decoder holds eh_proj, enorm, hnorm, shared_head.norm,
    shared_head.head and embed_tokens (copies of the target's), and a decoder layer under the family's own names
    (decoder layer `copy_of`'s tensors, default the last, with noise)."""
    import shutil
    from safetensors.torch import load_file

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    n, dim = cfg["num_hidden_layers"], cfg["hidden_size"]
    cfg["num_nextn_predict_layers"] = 1
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(dest / "model.safetensors"))
    at, new = f"model.layers.{copy_of if copy_of is not None else n - 1}.", f"model.layers.{n}."
    for name, t in list(tensors.items()):
        if name.startswith(at):
            tensors[new + name[len(at):]] = t + 0.3 * t.std() * torch.randn(t.shape, generator=g)
    tensors |= {new + "eh_proj.weight": torch.randn(dim, 2 * dim, generator=g) * STD,
                new + "enorm.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                new + "hnorm.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                new + "shared_head.norm.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                new + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                new + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
    for f in dest.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def write_qwen_mtp(src: Path, dest: Path, seed: int = 0) -> Path:
    """A copy of the Qwen3.5 / Qwen3-Next checkpoint at `src` with its MTP layer stored as published: mtp.fc
    [D, 2D], mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.* (the last full-attention decoder
    layer's tensors with noise) and mtp.norm; config mtp_num_hidden_layers 1. Norms are stored as (1 + w)
    norms store them: w near 0."""
    import shutil
    from safetensors.torch import load_file

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    dim = text["hidden_size"]
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(dest / "model.safetensors"))
    at = next(n[: n.index(f"layers.{full}.") + len(f"layers.{full}.")] for n in tensors if f"layers.{full}." in n)
    for name, t in list(tensors.items()):
        if name.startswith(at):
            tensors["mtp.layers.0." + name[len(at):]] = t + 0.3 * t.std() * torch.randn(t.shape, generator=g)
    tensors |= {"mtp.fc.weight": torch.randn(dim, 2 * dim, generator=g) * STD,
                "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(dim, generator=g),
                "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(dim, generator=g),
                "mtp.norm.weight": 0.1 * torch.randn(dim, generator=g)}
    for f in dest.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    return dest


def write_gemma4_assistant(dest: Path, target: Path, seed: int = 0, ordered: bool = False, dim: int = 48,
                           n_layers: int = 3, **text: object) -> Path:
    """A Gemma 4 assistant for the Gemma 4 checkpoint at `target`, written by transformers
    (Gemma4AssistantForCausalLM, random weights with noise on every norm and layer scalar): `n_layers` layers of
    width `dim`, sliding ones then a full one, the target's head sizes and window; ordered: the centroid head
    (16 centroids, top 4, a random token order)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    t = json.loads((target / "config.json").read_text())
    t = t.get("text_config", t)
    kinds = ["sliding_attention"] * (n_layers - 1) + ["full_attention"]
    full = next((e for e in (t.get("per_layer_config") or {}).values() if isinstance(e, dict)), {})
    t = {"global_head_dim": full.get("head_dim"), "num_global_key_value_heads": full.get("num_key_value_heads"),
         **{k: v for k, v in t.items() if v is not None}}
    text_cfg = Gemma4TextConfig(**{**dict(
        vocab_size=t["vocab_size"], hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
        global_head_dim=t.get("global_head_dim"), num_global_key_value_heads=t.get("num_global_key_value_heads"),
        attention_k_eq_v=t.get("attention_k_eq_v", False), sliding_window=t["sliding_window"], layer_types=kinds,
        hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=n_layers, max_position_embeddings=t["max_position_embeddings"],
        final_logit_softcapping=None, tie_word_embeddings=True), **text})
    cfg = Gemma4AssistantConfig(text_config=text_cfg, backbone_hidden_size=t["hidden_size"],
                                use_ordered_embeddings=ordered, num_centroids=16, centroid_intermediate_top_k=4)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
            elif name.endswith("token_ordering"):
                b.copy_(torch.randperm(b.numel(), generator=g))
    model.save_pretrained(dest)
    return dest
