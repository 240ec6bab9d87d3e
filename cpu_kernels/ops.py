"""CPU linears for 4-bit and 8-bit weights with int8 activations quantized on the fly: the compiled kernels
(csrc/q4.c, q8.c, built on first use by build.py) and their pure-torch twin, which runs wherever the kernels cannot
and is the reference the tests hold them to.

Weight layouts (made once, when a layer is quantized: offload/quant/int4.py, int8.py; never per call):
    q4  codes uint8 [N, K/2]: group g of G weights (G = 32, 64, 128) is the G/2 bytes from g*G/2; byte j holds
        weight g*G + j in its low nibble and g*G + G/2 + j in its high one (pack_q4 / unpack_q4).
        sz bfloat16 [N, K/G, 2]: (s, z) per output row and group, w = (q - 8) * s + z.
    q8  codes int8 [N, K], scale bfloat16 [N]: w = q * s (offload/quant/int8.py's own layout, read as it is).
Activations: each row of x is cut into blocks of B (q4: B = G; q8: B = 64), each block quantized to int8 with
d = amax / 127 and q = round_half_even(x * (127 / amax)) (`quantize_activations`: the same bits as the kernels).
The result is the exact sum of d * s * (integer dot) per block plus the zero terms, accumulated in fp32 in a
fixed order per output: a row's result does not depend on the other rows, the thread count or the ISA's tile.
So these linears equal `dequantize(W)` applied to the dequantized activations up to fp32 rounding (`*_reference`),
and equal the float matmul up to the activations' 8-bit rounding (llama.cpp's Q8 activations, blocks of 32/256).

Callers: QuantLinear on a CPU (offload/quant/linear.py), and any expert FFN: `q4_linear(x_rows, codes_e, sz_e,
G, out=buf)` for the rows routed to expert e, one call per projection, the weights being views of that expert's
packed region (no copy); `out=` takes a preallocated [rows, N] buffer.

quantize_q4 runs the compiled int4 range search (csrc/q4_quant.c) that offload/quant/int4.py asks for on a CPU.

Does not know: modules, layers, files, which search a format wants (int4.py names it, int8.py chooses its codes).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cpu_kernels.build import library

Q8_BLOCK = 64
_FLOATS = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------------------- layouts

def pack_q4(q: torch.Tensor, group: int) -> torch.Tensor:
    """Codes q [N, K] in [0, 15] (any integer dtype) -> uint8 [N, K/2] in the q4 layout."""
    n, k = q.shape
    g = q.reshape(n, k // group, group).to(torch.uint8)
    half = group // 2
    return (g[..., :half] | (g[..., half:] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(codes: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [N, K/2] in the q4 layout -> codes uint8 [N, K] in [0, 15]."""
    n, kh = codes.shape
    b = codes.reshape(n, kh // (group // 2), group // 2)
    return torch.cat([b & 15, b >> 4], dim=-1).reshape(n, 2 * kh)


def q4_dequantize(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The q4 weight [N, K] in fp32: (q - 8) * s + z."""
    n = codes.shape[0]
    q = unpack_q4(codes, group).reshape(n, -1, group).float()
    s, z = sz[..., 0].float().unsqueeze(-1), sz[..., 1].float().unsqueeze(-1)
    return ((q - 8) * s + z).reshape(n, -1)


def q8_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The q8 weight [N, K] in fp32: q * s (exact)."""
    return codes.float() * scale.float().unsqueeze(1)


def quantize_q4(w: torch.Tensor, group: int, clips: tuple[float, ...], refits: int,
                threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [N, K] (fp32 or bf16, CPU) -> (codes uint8 [N, K/2], sz bf16 [N, K/G, 2]) in the q4 layout, chosen by the
    compiled search (csrc/q4_quant.c: the start range [min, max] * clips[0], each further clip factor, then
    `refits` least-squares refits, each kept where a group's squared error is lower), rows on `threads` threads
    (default torch's). None when the library is not available: offload/quant/int4.py's pure-torch search (the
    same steps) runs instead."""
    lib = library()
    if lib is None:
        return None
    if w.dtype not in _FLOATS or not w.is_contiguous():
        w = w.float().contiguous()
    n, k = w.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    sz = torch.empty(n, k // group, 2, dtype=torch.bfloat16)
    factors = (ctypes.c_float * len(clips))(*clips)
    rc = lib.sx_q4_quantize(w.data_ptr(), int(w.dtype == torch.bfloat16), n, k, group, factors, len(clips), refits,
                            codes.data_ptr(), sz.data_ptr(), threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"sx_q4_quantize refused a weight [{n}, {k}] with group {group} ({rc})")
    return codes, sz


# ----------------------------------------------------------------------------------------- activations

def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], d fp32 [M, ceil(K/block)]): what the kernels compute, bit for bit."""
    m, k = x.shape
    nb = -(-k // block)
    xf = F.pad(x.float(), (0, nb * block - k)).view(m, nb, block)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = (xf * inv.unsqueeze(-1)).round_().clamp_(-127, 127)
    d = amax.div(torch.full_like(amax, 127.0))
    return q.to(torch.int8).view(m, nb * block)[:, :k], d


def dequantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] as the kernels see it: q * d per block, fp32."""
    q, d = quantize_activations(x, block)
    m, k = q.shape
    nb = d.shape[1]
    qf = F.pad(q.float(), (0, nb * block - k)).view(m, nb, block)
    return (qf * d.unsqueeze(-1)).view(m, nb * block)[:, :k]


# ----------------------------------------------------------------------------------------- references

def q4_reference(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, N]: the dequantized activations times the dequantized weight (the kernel up to fp32 order)."""
    y = F.linear(dequantize_activations(x, group), q4_dequantize(codes, sz, group))
    return y if bias is None else y + bias.float()


def q8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, N]: the dequantized activations times the q8 weight (the kernel up to fp32 order)."""
    y = F.linear(dequantize_activations(x, Q8_BLOCK), q8_dequantize(codes, scale))
    return y if bias is None else y + bias.float()


# ----------------------------------------------------------------------------------------- entry points

def _rows_out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as contiguous [M, K] fp32/bf16, the [M, N] output in x's dtype: `out` when given)."""
    if x.dtype not in _FLOATS:
        x = x.float()
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    elif out.shape != (rows.shape[0], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{rows.shape[0]}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    return rows, out


def _bias_arg(bias: torch.Tensor | None) -> tuple[int | None, int, torch.Tensor | None]:
    if bias is None:
        return None, 0, None
    b = bias if bias.dtype in _FLOATS and bias.is_contiguous() else bias.float().contiguous()
    return b.data_ptr(), int(b.dtype == torch.bfloat16), b


class BoundLinear:
    """One weight ready for repeated calls: `bound(x [..., K], out=None) -> [..., N]` in x's dtype, with the
    weight's pointers and the kernel looked up once (a decode step calls each linear once per token; this
    keeps a call to one ctypes call and the output's allocation). It holds the weight's tensors, so their
    memory outlives it; whoever replaces them (QuantLinear.bind, .to()) makes a new one."""

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, group: int,
                 bias: torch.Tensor | None) -> None:
        for name, t, dtype in (("codes", codes, torch.uint8 if kind == "q4" else torch.int8),
                               ("scales", scales, torch.bfloat16)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{kind} {name} must be a contiguous {dtype} CPU tensor, got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
        self.kind, self.codes, self.scales, self.group = kind, codes, scales, group
        self.n, self.k = codes.shape[0], codes.shape[1] * (2 if kind == "q4" else 1)
        self.bias_ptr, self.bias_bf16, self.bias = _bias_arg(bias)
        self.lib = library()
        self._run = None if self.lib is None else self._kernel_call()

    def _kernel_call(self) -> Callable[[int, int, int, int, int], int]:
        """run(x_ptr, bf16, rows, out_ptr, threads) -> rc: the kernel with every per-weight argument bound."""
        k, cp, sp, n, b, bb = (self.k, self.codes.data_ptr(), self.scales.data_ptr(), self.n, self.bias_ptr,
                               self.bias_bf16)
        if self.kind == "q4":
            fn, g = self.lib.sx_q4_linear, self.group
            return lambda xp, bf, m, yp, th: fn(xp, bf, m, k, cp, sp, n, g, b, bb, yp, bf, th)
        fn = self.lib.sx_q8_linear
        return lambda xp, bf, m, yp, th: fn(xp, bf, m, k, cp, sp, n, b, bb, yp, bf, th)

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kind == "q4":
            return q4_reference(rows, self.codes, self.scales, self.group, self.bias)
        return q8_reference(rows, self.codes, self.scales, self.bias)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.k:
            raise ValueError(f"x has {x.shape[-1]} features, the {self.kind} weight [{self.n}, {self.k}] takes "
                             f"{self.k}")
        if self._run is not None and out is None and x.dtype in _FLOATS and x.is_contiguous():
            y = torch.empty((*x.shape[:-1], self.n), dtype=x.dtype)     # the fast path: no reshape, no view
            self._check(self._run(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // self.k, y.data_ptr(),
                                  torch.get_num_threads()), x)
            return y
        rows, y = _rows_out(x, self.n, out)
        if self._run is None:
            y.copy_(self.reference(rows))
        else:
            self._check(self._run(rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0], y.data_ptr(),
                                  torch.get_num_threads()), rows)
        return y.view(*x.shape[:-1], self.n)

    def _check(self, rc: int, x: torch.Tensor) -> None:
        if rc:
            raise RuntimeError(f"sx_{self.kind}_linear failed ({rc}) on x {list(x.shape)}, W [{self.n}, {self.k}]")


def q4_linear(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, group: int,
              bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) @ W.T (+ bias) -> [..., N] in x's dtype, W a q4 weight (module docstring)."""
    return BoundLinear("q4", codes, sz, group, bias)(x, out)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) @ W.T (+ bias) -> [..., N] in x's dtype, W a q8 weight (module docstring)."""
    return BoundLinear("q8", codes, scale, 0, bias)(x, out)
