"""AWQ and GPTQ checkpoints written the way their tools write them (a helper of tests/offload/): weights
quantized group-wise here and packed as AutoAWQ (GEMM, interleaved columns) and AutoGPTQ (v1 zeros - 1, sym and
asym, act-order g_idx; GPTQModel's v2 zeros; 8-bit) pack them, with their quantization_config in config.json,
beside a dense checkpoint of the dequantized reference weights.

The packers follow the writers' own loops (AutoAWQ WQLinear_GEMM.from_linear, AutoGPTQ QuantLinear.pack),
independent of the vectorised unpacking under test.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from offload.formats.awq_gptq import AWQ_ORDER

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
@dataclass(frozen=True)
class Variant:
    method: str              # awq | gptq
    bits: int = 4
    group: int = 32
    sym: bool = False
    act_order: bool = False
    v2: bool = False         # GPTQModel's gptq_v2: zeros stored as they are

    def config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group, "zero_point": True, "version": "gemm"}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group, "sym": self.sym,
                "desc_act": self.act_order, "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}


VARIANTS = {
    "awq": Variant("awq"),
    "gptq-asym": Variant("gptq"),
    "gptq-sym": Variant("gptq", sym=True),
    "gptq-act-order": Variant("gptq", sym=True, act_order=True),
    "gptq-v2": Variant("gptq", v2=True),
    "gptq-8bit": Variant("gptq", bits=8),
    "gptq-per-channel": Variant("gptq", group=-1),
}


# ------------------------------------------------------------------------------------------ quantize + pack

def quantize(w: torch.Tensor, v: Variant, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Group-wise int quantization of W [out, in] as GPTQ/AWQ define it: (q [out, in], zeros [groups, out],
    scales fp16 [groups, out], g_idx [in]). Act-order: groups are runs of a random column permutation."""
    n_out, n_in = w.shape
    maxq = 2 ** v.bits - 1
    group = n_in if v.group < 0 else v.group
    perm = torch.randperm(n_in, generator=gen) if v.act_order else torch.arange(n_in)
    g_idx = torch.empty(n_in, dtype=torch.int32)
    g_idx[perm] = (torch.arange(n_in) // group).int()
    n_groups = -(-n_in // group)
    scales, zeros = torch.empty(n_groups, n_out, dtype=torch.float16), torch.empty(n_groups, n_out, dtype=torch.int32)
    q = torch.empty(n_out, n_in, dtype=torch.int32)
    for g in range(n_groups):
        cols = (g_idx == g).nonzero().view(-1)
        lo, hi = w[:, cols].min(1).values.clamp(max=0), w[:, cols].max(1).values.clamp(min=0)
        if v.sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / maxq).clamp(min=1e-8).half()
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int32) if v.sym else \
            torch.round(-lo / scale.float()).clamp(0, maxq).int()
        scales[g], zeros[g] = scale, zero
        q[:, cols] = torch.clamp(torch.round(w[:, cols] / scale.float()[:, None]) + zero[:, None], 0, maxq).int()
    return q, zeros, scales, g_idx


def reference(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The dequantized weight [out, in], float32: (q - z) * s per input column's group."""
    g = g_idx.long()
    return (q - zeros[g].t()).float() * scales[g].t().float()


def pack_awq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ WQLinear_GEMM.from_linear: intweight [in, out]; column col*8 + AWQ_ORDER[i] in nibble i."""
    def pack(int_rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(int_rows.shape[0], int_rows.shape[1] // 8, dtype=torch.int64)
        for col in range(int_rows.shape[1] // 8):
            for i in range(8):
                out[:, col] |= int_rows[:, col * 8 + AWQ_ORDER[i]].long() << (i * 4)
        return _int32(out)
    return pack(q.t().contiguous()), pack(zeros)


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ QuantLinear.pack: qweight packs IN rows low bits first; qzeros packs OUT columns, v1 storing
    zero - 1."""
    per = 32 // bits
    intweight = q.t().contiguous().long()                       # [in, out]
    qweight = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    stored = zeros.long() - (0 if v2 else 1)
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // per, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= (stored[:, col * per + j] & (2 ** bits - 1)) << (bits * j)
    return _int32(qweight), _int32(qzeros)


def _int32(x: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the int32 tensor the checkpoints store."""
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def write_packed(src: Path, dest: Path, v: Variant, seed: int = 0) -> tuple[Path, Path]:
    """(packed checkpoint, dense checkpoint of its reference weights), both copies of src's directory."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    packed, dense = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] not in LINEARS or not name.endswith(".weight"):
            continue
        prefix = name.removesuffix(".weight")
        q, zeros, scales, g_idx = quantize(w.float(), v, gen)
        dense[name] = reference(q, zeros, scales, g_idx)
        qweight, qzeros = pack_awq(q, zeros) if v.method == "awq" else pack_gptq(q, zeros, v.bits, v.v2)
        del packed[name]
        packed.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        if v.method == "gptq":
            packed[f"{prefix}.g_idx"] = g_idx
    out = []
    for kind, state, qc in (("packed", packed, v.config()), ("dense", dense, None)):
        d = dest / kind
        shutil.copytree(src, d)
        save_file({k: t.contiguous() for k, t in state.items()}, d / "model.safetensors", metadata={"format": "pt"})
        if qc is not None:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        out.append(d)
    return out[0], out[1]
