"""Training a small EAGLE-3 head with training-time test (EAGLE-3, arXiv 2503.01840), and saving it in the
published layout (config.json + model.safetensors: midlayer.*, fc, norm, lm_head, d2t, t2d) so that
`--draft eagle3:DIR` loads it like any published head.

The head IS specexec's Drafter (specexec/network/drafter.py): training runs its modules, so what is trained is
what runs. Training-time test unrolls S steps per sequence: step 0's row t reads the target's fused state at t
and token t+1; step s's row t reads step s-1's output at row t and token t+1+s, at position t+s, attending to
step 0's rows 0..t and to its own chain's rows of steps 1..s (exactly what a chain node of depth s sees in a
tree: the committed rows, then its ancestors). Each step predicts the target's argmax after its token
(cross-entropy over the head's vocabulary), step s weighted 0.8^s.

Does not know: where the data came from (data.py), the engine.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specexec.drafters import eagle3
from specexec.network.drafter import Drafter, Eagle3Drafter
from specexec.network.rope import apply_rope
from tools.eagle_head.data import Sample

IGNORE = -100


def head_config(target, taps: tuple[int, ...], vocab: torch.Tensor, intermediate: int) -> dict:
    """The head's config.json: a one-layer Llama decoder of the target's width and attention shape."""
    a = target.args
    return dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=a.dim,
                intermediate_size=intermediate, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                head_dim=a.head_dim, num_hidden_layers=1, vocab_size=a.vocab_size, rms_norm_eps=a.norm_eps,
                rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings, hidden_act="silu",
                tie_word_embeddings=False, draft_vocab_size=int(vocab.numel()), target_hidden_size=a.dim,
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(taps), "use_aux_hidden_state": True})


def new_head(target, cfg: dict, vocab: torch.Tensor, seed: int = 0) -> Drafter:
    """The head with fresh weights: linears ~ N(0, 0.02) (o_proj and down_proj smaller), norms from the target's
    final norm, the LM head from the target's rows of the head's vocabulary; the target's embedding (frozen)."""
    torch.manual_seed(seed)
    args, shape = eagle3.shape_of(cfg, target.args, Path("(training)"))
    head = Eagle3Drafter.build(args, shape)
    for name, p in list(head.named_parameters()):
        if name.startswith("embed_tokens"):
            continue
        owner, attr = _owner(head, name)
        if name.endswith("norm.weight"):
            value = target.norm.weight.detach().float().clone()
        elif name == "lm_head.weight":
            value = target.head_weight.detach().float()[vocab].clone()
        else:
            std = 0.02 / (math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            value = torch.randn(p.shape) * std
        setattr(owner, attr, nn.Parameter(value))
    head.d2t = vocab - torch.arange(vocab.numel())
    head.share(target, embed=True)
    head.init_rope("cpu")
    return head


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, attr = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr


def unrolled_loss(head: Drafter, s: Sample, to_draft: torch.Tensor, steps: int) -> tuple[torch.Tensor, list]:
    """Training-time test over one sample (module docstring) -> (weighted loss, per-step (correct, counted))."""
    block, attn = head.layers[0], head.layers[0].mixer
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    T = s.tokens.numel()
    with torch.no_grad():
        emb = head.embed(s.tokens[None])[0].float()
    state = head.fuse(s.taps)                                           # the target's fused state at each position
    keys0 = vals0 = None
    diag_k, diag_v = [], []
    total, stats = 0.0, []
    for step in range(steps):
        n = T - 1 - step                                                # rows t = 0 .. n-1 have token t+1+step
        if n < 2:
            break
        normed = block.hidden_norm(state[:n])
        x = torch.cat([block.input_layernorm(emb[1 + step:1 + step + n]), normed], -1)
        pos = torch.arange(step, step + n)
        cos, sin = head.rope(pos[None], x.dtype)
        q = apply_rope(attn.q_proj(x).view(1, n, H, hd).transpose(1, 2), cos, sin)[0]       # [H, n, hd]
        k = apply_rope(attn.k_proj(x).view(1, n, KV, hd).transpose(1, 2), cos, sin)[0]
        v = attn.v_proj(x).view(n, KV, hd).transpose(0, 1)
        if step == 0:
            keys0, vals0 = k, v
        else:
            diag_k, diag_v = [d[:, :n] for d in diag_k] + [k], [d[:, :n] for d in diag_v] + [v]
        out = _attend(q, keys0, vals0, diag_k if step else [], diag_v if step else [], H // KV)
        y = (normed if head.shape.norm_before_residual else state[:n]) + attn.o_proj(out)
        y = y + block.mlp(block.post_attention_layernorm(y))
        labels = to_draft[s.argmax[1 + step:1 + step + n]]
        logits = head.lm_head(head.norm(y))
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE)
        total = total + (0.8 ** step) * loss
        ok = labels != IGNORE
        stats.append((int((logits.argmax(-1) == labels)[ok].sum()), int(labels.numel())))
        state = y
    return total, stats


def _attend(q, k0, v0, dk, dv, rep: int) -> torch.Tensor:
    """q [H, n, hd] over step 0's keys k0/v0 [KV, n0, hd] causally (row t sees 0..t) and each diagonal key of the
    later steps dk/dv (each [KV, n, hd], row t sees its own) -> [n, H*hd]."""
    H, n, hd = q.shape
    k0, v0 = k0.repeat_interleave(rep, 0), v0.repeat_interleave(rep, 0)
    scores = (q @ k0[:, :].transpose(1, 2)) / math.sqrt(hd)                   # [H, n, n0]
    visible = torch.ones(n, k0.shape[1], dtype=torch.bool).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    diag = [(q * d.repeat_interleave(rep, 0)).sum(-1, keepdim=True) / math.sqrt(hd) for d in dk]   # [H, n, 1]
    w = torch.cat([scores] + diag, -1).softmax(-1)
    out = w[..., :k0.shape[1]] @ v0
    for j, d in enumerate(dv):
        out = out + w[..., k0.shape[1] + j:k0.shape[1] + j + 1] * d.repeat_interleave(rep, 0)
    return out.transpose(0, 1).reshape(n, H * hd)


def train(head: Drafter, train_set: list[Sample], vocab: torch.Tensor, seconds: float, steps: int, say,
          lr: float = 1e-3) -> dict:
    """AdamW on the head's own weights until `seconds` pass (cosine decay over the time), one sample per step,
    gradients clipped at 1; -> what it did."""
    to_draft = torch.full((head.args.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[vocab] = torch.arange(vocab.numel())
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    t0, done, epoch, order = time.perf_counter(), 0, 0, []
    recent: list[list] = []
    while time.perf_counter() - t0 < seconds:
        if not order:
            order, epoch = random.Random(epoch).sample(range(len(train_set)), len(train_set)), epoch + 1
        frac = (time.perf_counter() - t0) / seconds
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (done + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        loss, stats = unrolled_loss(head, train_set[order.pop()], to_draft, steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done += 1
        recent = (recent + [stats])[-40:]
        if done % 20 == 0:
            say(f"step {done} epoch {epoch} loss {loss.item():.3f} top-1 by depth " + " ".join(
                f"{sum(s[i][0] for s in recent if len(s) > i) / max(1, sum(s[i][1] for s in recent if len(s) > i)):.2f}"
                for i in range(steps)) + f" ({time.perf_counter() - t0:.0f} s)")
    return {"optimizer_steps": done, "epochs": epoch, "seconds": round(time.perf_counter() - t0, 1)}


@torch.no_grad()
def top1(head: Drafter, samples: list[Sample], vocab: torch.Tensor, steps: int) -> list[float]:
    """Held-out top-1 agreement with the target at each unrolled depth."""
    to_draft = torch.full((head.args.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[vocab] = torch.arange(vocab.numel())
    sums = [[0, 0] for _ in range(steps)]
    for s in samples:
        _, stats = unrolled_loss(head, s, to_draft, steps)
        for i, (c, n) in enumerate(stats):
            sums[i][0] += c
            sums[i][1] += n
    return [round(c / max(n, 1), 3) for c, n in sums]


def save(head: Drafter, cfg: dict, vocab: torch.Tensor, dest: Path) -> Path:
    """The head in the published EAGLE-3 layout (midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding)."""
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        stored = name.replace("layers.0.", "midlayer.", 1).replace("fuse.", "fc.", 1)
        tensors[stored] = p.detach().float().contiguous()
    tensors["d2t"] = (vocab - torch.arange(vocab.numel())).contiguous()
    t2d = torch.zeros(head.args.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


@torch.no_grad()
def check_saved(head: Drafter, loaded: Drafter, s: Sample) -> float:
    """The largest difference between the trained head's step-0 logits and the saved-then-loaded head's (run as
    the engine runs it) on one sample: what was trained is what runs."""
    n = s.tokens.numel() - 1
    states = loaded.fuse(s.taps[:n])
    out = loaded(s.tokens[None, 1:], torch.arange(n)[None], states=states[None])
    got = loaded.logits(out)
    emb = head.embed(s.tokens[None])[0]
    block = head.layers[0]
    state = head.fuse(s.taps[:n])
    x = torch.cat([block.input_layernorm(emb[1:]), block.hidden_norm(state)], -1)
    pos = torch.arange(n)
    cos, sin = head.rope(pos[None], x.dtype)
    attn = block.mixer
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rope(attn.q_proj(x).view(1, n, H, hd).transpose(1, 2), cos, sin)[0]
    k = apply_rope(attn.k_proj(x).view(1, n, KV, hd).transpose(1, 2), cos, sin)[0]
    v = attn.v_proj(x).view(n, KV, hd).transpose(0, 1)
    y = state + attn.o_proj(_attend(q, k, v, [], [], H // KV))
    y = y + block.mlp(block.post_attention_layernorm(y))
    want = head.lm_head(head.norm(y))
    ids = torch.arange(want.shape[1]) + loaded.d2t
    return float((got[:, ids] - want).abs().max())
