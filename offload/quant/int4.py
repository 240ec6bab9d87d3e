"""Group-wise asymmetric 4-bit weights: on the CPU in the q4 layout of specexec's integer kernels
(cpu_kernels/), on CUDA packed for torch's int4 kernel aten._weight_int4pack_mm ("tinygemm",
compute capability 8.0+).

A weight [out, in] is cut along `in` into groups of G (32, 64 or 128; default 64). Each group gets a bf16 scale s
and zero z (the value of code 8) and each weight a 4-bit code q in [0, 15]: w ~ (q - 8) * s + z, with the group's
range [min, max] shrunk by whichever of a few factors (CLIP) gives the least squared error, then refit by least
squares to its codes where that helps (SEARCHES: "default"; "quality", `convert --quality`, tries 21 factors and 4
refits). On a CPU the search runs compiled (cpu_kernels/csrc/q4_quant.c: each group in registers, one pass over the
weight, threaded over rows); _best_codes is its pure-torch twin (the same steps, on CUDA and where no library is). The codes and (s, z) are the same on both devices; only their order differs:
    ".qdata"         CPU:  uint8 [out, in/2], group g's G/2 bytes from g*G/2, byte j = code g*G + j (low nibble)
                           and code g*G + G/2 + j (high nibble)  (cpu_kernels.ops.pack_q4)
                     CUDA: int32 [out/8, in/(16 t), 32, t/2] for t inner k tiles (2, 4 or 8)
    ".scales_zeros"  bf16 (s, z) per group and output channel: CPU [out, in/G, 2], CUDA [in/G, out, 2]
Weight meta: {"format": "int4", "shape", "dtype", "group", "packing", "inner_k_tiles" (CUDA only)}. `packing`
names the layout ("cpu-q4-v1"; "cuda-tinygemm-<torch version>"), so a layer packed for the other device or an
older layout is refused at bind time and the layer cache keys on it. The CPU layout depends on no ISA, torch build
or compiler: the same cache serves the compiled kernels and their pure-torch twin.

The CPU kernel takes fp32 or bf16 activations, quantizes them to int8 per group (cpu_kernels.ops) and accumulates
in fp32 in a fixed order per output; the CUDA kernel takes bf16 and rounds each output to bf16. On both, a row's
result does not depend on the other rows of the batch (CPU: tested bit for bit for 1..257 rows, 1 or 2 threads;
CUDA: asserted by a gpu-marked test).

Shapes the kernels take: out % 16 == 0, in % 32 == 0 (`fits`); the caller stores other weights another way.

Does not know: modules, layers, files, formats other than its own.
"""
from __future__ import annotations

import functools

import torch

from cpu_kernels import ops as cpu_ops

GROUPS = (32, 64, 128)
DEFAULT_GROUP = 64
CLIP = (1.0, 0.9, 0.8)        # range factors tried per group (1.0 = min-max)
REFITS = 2                    # least-squares refits of each group's range to its codes
SEARCHES = {                  # --quality's name -> (range factors, refits): how hard each group's range is sought
    "default": (CLIP, REFITS),
    "quality": (tuple(round(1.0 - 0.025 * k, 3) for k in range(21)), 4),     # 1.0, 0.975, ..., 0.5
}
CPU_PACKING = "cpu-q4-v1"     # the CPU layout's name (cpu_kernels.ops); a new layout gets a new name


def fits(shape: tuple[int, int]) -> bool:
    """Whether a weight [out, in] can be packed for both kernels (out % 16 == 0 and in % 32 == 0)."""
    out_f, in_f = shape
    return out_f % 16 == 0 and in_f % 32 == 0 and out_f > 0 and in_f > 0


def group_for(in_features: int, group: int = DEFAULT_GROUP) -> int:
    """The group size used for `in_features`: `group` if it divides it, else the largest smaller one that does."""
    if group not in GROUPS:
        raise ValueError(f"int4 group size {group} is not one of {', '.join(map(str, GROUPS))}")
    for g in sorted(GROUPS, reverse=True):
        if g <= group and in_features % g == 0:
            return g
    raise ValueError(f"int4 needs in_features divisible by 32, got {in_features}")


def inner_k_tiles(in_features: int) -> int:
    """CUDA packing parameter: 8 when in % 128 == 0, else 4 (in % 64), else 2."""
    return 8 if in_features % 128 == 0 else 4 if in_features % 64 == 0 else 2


def cuda_supported(device: torch.device | str) -> str | None:
    """None when int4 runs on this CUDA device, else the reason (one line)."""
    device = torch.device(device)
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int4pack_mm", "CUDA")
    except (AttributeError, RuntimeError):
        has = False
    if not has:
        return "this torch build has no CUDA int4 kernel (aten._weight_int4pack_mm)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "the CUDA int4 kernel needs compute capability 8.0 or newer"
    return None


@functools.cache
def packing(device_type: str) -> str:
    """The name of the packed layout the int4 kernel of `device_type` ("cpu" | "cuda") reads."""
    if device_type == "cuda":
        return f"cuda-tinygemm-{torch.__version__.split('+')[0]}"
    if device_type != "cpu":
        raise ValueError(f"int4 runs on cpu or cuda, not {device_type}")
    return CPU_PACKING


def specs(shape: tuple[int, int], device_type: str, group: int = DEFAULT_GROUP
          ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """({suffix: (dtype, shape)}, meta extras) of a weight [out, in] packed for `device_type`, from its shape."""
    out_f, in_f = shape
    g = group_for(in_f, group)
    extra: dict = {"group": g, "packing": packing(device_type)}
    if device_type == "cuda":
        t = inner_k_tiles(in_f)
        extra["inner_k_tiles"] = t
        qspec = (torch.int32, (out_f // 8, in_f // (16 * t), 32, t // 2))
        return {".qdata": qspec, ".scales_zeros": (torch.bfloat16, (in_f // g, out_f, 2))}, extra
    return {".qdata": (torch.uint8, (out_f, in_f // 2)),
            ".scales_zeros": (torch.bfloat16, (out_f, in_f // g, 2))}, extra


def check_search(search: str) -> str:
    if search not in SEARCHES:
        raise ValueError(f"unknown int4 search {search!r}; choose one of {', '.join(SEARCHES)}")
    return search


def quantize(weight: torch.Tensor, group: int = DEFAULT_GROUP, search: str = "default"
             ) -> tuple[dict[str, torch.Tensor], dict]:
    """weight [out, in] (any float dtype, on cpu or cuda) -> ({".qdata", ".scales_zeros"}, meta extras), packed
    for the weight's device. Codes are chosen against the bf16-rounded scale and zero the kernel will use, by the
    range search SEARCHES[search] names: on a CPU the compiled one (cpu_kernels/csrc/q4_quant.c, one pass over
    the weight) where the library is available, else the pure-torch _best_codes (the same steps)."""
    clips, refits = SEARCHES[check_search(search)]
    out_f, in_f = weight.shape
    if not fits((out_f, in_f)):
        raise ValueError(f"int4 needs out % 16 == 0 and in % 32 == 0, got a weight of shape [{out_f}, {in_f}]")
    device_type = weight.device.type
    if device_type == "cuda" and (why := cuda_supported(weight.device)):
        raise ValueError(f"int4 on {weight.device}: {why}; use nf4")
    g = group_for(in_f, group)
    extra: dict = {"group": g, "packing": packing(device_type)}
    if device_type != "cuda" and (done := cpu_ops.quantize_q4(weight.detach(), g, clips, refits)) is not None:
        return {".qdata": done[0], ".scales_zeros": done[1]}, extra
    w = weight.detach().float().reshape(out_f, in_f // g, g)
    q, scale, zero = _best_codes(w, clips=clips, refits=refits)
    if device_type != "cuda":
        scales_zeros = torch.stack([scale, zero], dim=-1).contiguous()                     # [out, in/g, 2]
        return {".qdata": cpu_ops.pack_q4(q.reshape(out_f, in_f), g), ".scales_zeros": scales_zeros}, extra
    q = q.reshape(out_f, in_f)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()      # [in/g, out, 2]
    t = inner_k_tiles(in_f)
    extra["inner_k_tiles"] = t
    pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    qdata = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), t)
    return {".qdata": qdata.contiguous(), ".scales_zeros": scales_zeros}, extra


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (scale, zero) of the range [lo, hi] per group, as the kernel will read them."""
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    return scale, (lo + 8 * scale.float()).to(torch.bfloat16)


def _codes(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Float codes in [0, 15] for groups w [..., G] on the range [lo, hi] per group (bf16-rounded scale/zero)."""
    scale, zero = _scale_zero(lo, hi)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    return torch.sub(w, z - 8 * s).div_(s).round_().clamp_(0, 15)


def _error(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Squared error per group of coding w [..., G] on the range [lo, hi] (one temporary, in place)."""
    scale, zero = _scale_zero(lo, hi)
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    t = _codes(w, lo, hi)
    return t.sub_(8).mul_(s).add_(z).sub_(w).square_().sum(-1)


def _refit(w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares range for fixed codes q: fit w ~ a q + b per group; (lo, hi) = (b, b + 15 a)."""
    mq, mw = q.mean(-1, keepdim=True), w.mean(-1, keepdim=True)
    dq = q - mq
    a = ((dq * (w - mw)).sum(-1) / dq.square_().sum(-1).clamp(min=1e-12)).clamp(min=1e-8)
    lo = mw.squeeze(-1) - a * mq.squeeze(-1)
    return lo, lo + 15 * a


def _best_range(w: torch.Tensor, clips: tuple[float, ...] = CLIP, refits: int = REFITS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per group of w [rows, n, G]: [min, max] * clips[0] (1: the plain range), then shrunk by each further
    factor of `clips` where that lowers the squared error (clipping a few outliers buys resolution for the rest),
    then `refits` least-squares refits of the range to its codes, each kept only where it lowers the error."""
    lo0, hi0 = w.amin(-1), w.amax(-1)
    lo, hi = lo0 * clips[0], hi0 * clips[0]
    err = _error(w, lo, hi)
    candidates = [lambda f=f: (lo0 * f, hi0 * f) for f in clips[1:]]
    candidates += [lambda: _refit(w, _codes(w, lo, hi))] * refits
    for make in candidates:
        c_lo, c_hi = make()
        c_err = _error(w, c_lo, c_hi)
        better = c_err < err
        lo, hi, err = torch.where(better, c_lo, lo), torch.where(better, c_hi, hi), torch.minimum(c_err, err)
    return lo, hi


def _best_codes(w: torch.Tensor, rows: int = 256, clips: tuple[float, ...] = CLIP, refits: int = REFITS
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [out, n, G], scale bf16 [out, n], zero bf16 [out, n]) for groups w [out, n, G] (_best_range),
    in chunks of `rows` output channels so the temporaries stay in cache."""
    qs, scales, zeros = [], [], []
    for wc in w.split(rows):
        lo, hi = _best_range(wc, clips, refits)
        scale, zero = _scale_zero(lo, hi)
        qs.append(_codes(wc, lo, hi).to(torch.int32))
        scales.append(scale)
        zeros.append(zero)
    return torch.cat(qs), torch.cat(scales), torch.cat(zeros)


def check_packing(qdata: torch.Tensor, meta: dict) -> None:
    """ValueError unless `meta` was packed for the layout the kernel of qdata's device uses in this process."""
    here = packing(qdata.device.type)
    if meta.get("packing") != here:
        raise ValueError(f"this int4 weight was packed as {meta.get('packing')!r}, but the {qdata.device.type} "
                         f"kernel here reads {here!r} (another machine or torch build): rebuild the layer cache")


def matmul(x: torch.Tensor, parts: dict[str, torch.Tensor], meta: dict, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [M, in] (contiguous) @ W.T (+ bias) -> [M, out], on x's device. CPU: x fp32 or bf16, the result in x's
    dtype (cpu_kernels.ops.q4_linear); CUDA: x bf16, the result bf16, bias added after."""
    qdata, sz = parts[".qdata"], parts[".scales_zeros"]
    if x.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(x, qdata, meta["group"], sz)
        return y if bias is None else y + bias.to(y.dtype)
    return cpu_ops.q4_linear(x, qdata, sz, meta["group"], bias)


def dequantize(parts: dict[str, torch.Tensor], meta: dict, chunk: int = 512) -> torch.Tensor:
    """The weight [out, in] as the kernel sees it: CPU fp32 (q - 8) * s + z; CUDA the kernel applied to rows of
    the identity (each output is 1 * w + 0 * ..., exact before its bf16 rounding). For tests and error reports."""
    if parts[".qdata"].device.type != "cuda":
        return cpu_ops.q4_dequantize(parts[".qdata"], parts[".scales_zeros"], meta["group"])
    out_f, in_f = meta["shape"]
    device = parts[".qdata"].device
    w = torch.empty(out_f, in_f, dtype=torch.bfloat16, device=device)
    for k0 in range(0, in_f, chunk):
        k1 = min(in_f, k0 + chunk)
        eye = torch.zeros(k1 - k0, in_f, dtype=torch.bfloat16, device=device)
        eye[:, k0:k1].fill_diagonal_(1)
        w[:, k0:k1] = matmul(eye, parts, meta).t()
    return w
