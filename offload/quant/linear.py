"""A drop-in replacement for nn.Linear that computes with a quantized weight (offload/quant/weights.py) on CPU
and CUDA, and the kernel each format runs.

A module can be re-pointed at another layer's views without allocating, so one slot module serves every
streamed layer.

Does not know: how weights are quantized or laid out (weights.py, int4.py, int8.py), model architectures beyond
"2-D weights of nn.Linear", tokens, offloading, files.

CONTRACT (used by specexec/runtime/offloaded.py, the pager and the draft):

    class QuantLinear(nn.Module):     QuantLinear(in_features, out_features, bias, fmt, dtype, row_exact=True)
        forward(x [..., in]) -> [..., out] in x's dtype, through `kernel_for(format, device, row_exact)`:
            "linear" (fmt none), "dequantize" (the whole weight once per call, any number of tokens, then ONE
            F.linear), "int4-cpu" / "int8-cpu" (specexec's integer CPU kernels, cpu_kernels/: x in
            its own dtype, quantized to int8 per block inside the call, the result in x's dtype, bias added by
            the kernel; their pure-torch twin where no compiler built them), "int4pack" / "int8pack" (torch's
            CUDA weight-only kernels: x is cast to bf16 and the result back to x's dtype inside the call, so an
            fp32 residual stream stays fp32), "bnb-4bit" (bitsandbytes' 4-bit inference GEMM: fused where
            bitsandbytes' own per-GPU heuristics say so; CUDA draft only).
            row_exact=True (the default, and always for a target) allows only kernels whose result for a row
            does not depend on the batch's other rows.
        bind(views, meta, prefix): point at views["<prefix>.weight*"] and views["<prefix>.bias"] (prefix = the
            module's path inside the layer, e.g. "self_attn.q_proj"; meta = the layer meta from
            quantize_tensors). No tensor is allocated; the pager uses it to re-target a slot module.
        dequantize() -> [out, in] in the stored dtype (int4 on CUDA: the kernel's values, rounded to bf16).
        from_linear(linear, fmt, dtype, double_quant=False, row_exact=True) -> QuantLinear  (owns its tensors)

    def swap_linears(module: nn.Module, fmt: str, dtype: torch.dtype) -> None
        Replace every nn.Linear inside `module` by an unbound QuantLinear of format fmt (meta-device friendly:
        nothing is allocated; bind_module fills it).
    def bind_module(module: nn.Module, views: dict[str, torch.Tensor], meta: dict) -> None
        Point every QuantLinear and every remaining parameter of `module` at the views of one unpacked layer
        (names as in module.named_parameters(); quantized weights under their "<name>.*" keys).
    def quantize_module(module: nn.Module, fmt: str, dtype: torch.dtype, double_quant: bool = False,
                        row_exact: bool = True) -> None
        Resident use (draft, GPU-resident target layers): swap every nn.Linear for a QuantLinear that owns
        its quantized weight (quantized on the module's device), cast the other parameters to dtype.

    kernel_for(fmt, device_type, row_exact=True) -> the kernel a QuantLinear runs (see above).
    pass_traffic(module, device_type=None) -> bytes one forward of `module`'s linears moves, per kernel.

Exactness: every kernel a row-exact QuantLinear runs gives each row a result that depends only on that row and
the packed bytes (the CPU integer kernels and torch's CUDA int4/int8 kernels accumulate each output on its own
in a fixed order: bit for bit for 1..257 rows, tested; dequantize -> F.linear, and the integer kernels' pure-torch
twin, inherit the BLAS's behaviour, whose fp32 rows on a CPU differ in the last bit for some batch sizes), and
never on which tier the bytes came from. Caveat for int4/int8: their activation roundings (int8 per block on the
CPU, bf16 on CUDA) turn a last-bit difference arriving from elsewhere (CPU attention gives a row slightly
different bits in a tree pass than in a one-token pass) into a rounding-step difference, so a greedy near-tie
can (rarely) resolve differently from a one-token decode; the linears themselves add no difference.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels.ops import BoundLinear
from offload.quant import int4
from offload.quant import int8
from offload.quant.weights import (
    FORMATS, bnb_functional, check_format, dequantize, dtype_name, quantize_weight, weight_specs)

# ----------------------------------------------------------------------------------------- kernels

PART_SUFFIXES = ("", ".qdata", ".absmax", ".code", ".nested_absmax", ".nested_code", ".nested_offset", ".scale",
                 ".scales_zeros")
_BUFFERS = {s: "weight" if s == "" else s[1:] for s in PART_SUFFIXES}   # suffix -> buffer attribute name
_ACCEPTS = {f: {f} for f in FORMATS} | {"int4": {"int4", "int8"}}        # layer format -> weight formats it binds
KERNELS = ("linear", "dequantize", "int4-cpu", "int8-cpu", "int4pack", "int8pack", "bnb-4bit")


@functools.cache
def _bnb_gemm_4bit() -> bool:
    """Whether bitsandbytes registers its 4-bit inference GEMM op (bitsandbytes >= 0.48)."""
    bnb_functional()
    try:
        torch.ops.bitsandbytes.gemm_4bit
    except (AttributeError, RuntimeError):
        return False
    return True


def kernel_for(fmt: str, device_type: str, row_exact: bool = True) -> str:
    """The computation a QuantLinear holding a weight of format fmt runs on `device_type` (one of KERNELS).

    row_exact: only kernels whose result for a row does not depend on the other rows (the target's layers). The
    draft passes False: on CUDA its NF4/FP4 weights then go through bitsandbytes' 4-bit GEMM (a fused kernel
    for few rows, chosen per GPU and shape by bitsandbytes) instead of dequantizing the whole weight per call."""
    if fmt == "none":
        return "linear"
    if fmt in ("int4", "int8") and device_type == "cpu":
        return f"{fmt}-cpu"
    if fmt == "int4":
        return "int4pack"
    if fmt == "int8":
        return "int8pack" if not row_exact and int8.cuda_kernel() else "dequantize"
    if device_type == "cuda" and not row_exact and _bnb_gemm_4bit():
        return "bnb-4bit"
    return "dequantize"


def _bnb_gemm(x: torch.Tensor, parts: dict[str, torch.Tensor], wmeta: dict, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """bitsandbytes' 4-bit inference GEMM: x [M, in] in its dtype -> [M, out], bias added by the kernel."""
    gemm = torch.ops.bitsandbytes.gemm_4bit.default
    shape, bs, qt = list(wmeta["shape"]), wmeta["blocksize"], wmeta["format"]
    if ".nested_absmax" not in parts:
        return gemm(x, parts[".qdata"], shape, parts[".absmax"], bs, qt, bias=bias)
    return gemm(x, parts[".qdata"], shape, parts[".nested_absmax"], bs, qt, bias=bias,
                absmax_8bit=parts[".absmax"], absmax_code=parts[".nested_code"], absmax_offset=parts[".nested_offset"])


def linear_traffic(shape: tuple[int, int], fmt: str, dtype: torch.dtype, device_type: str, row_exact: bool = True,
                   double_quant: bool = False) -> dict:
    """What one call of a QuantLinear [out, in] moves: {"format", "kernel", "weight_bytes" (packed bytes read),
    "dequant_bytes" (a dequantized copy written and read again, 0 for fused kernels)}. Independent of the
    number of rows (activations are not counted)."""
    specs, wmeta = weight_specs(shape, fmt, dtype, double_quant, device_type)
    fmt = wmeta["format"]
    weight = sum(dt.itemsize * math.prod(s) for dt, s in specs.values())
    kernel = kernel_for(fmt, device_type, row_exact)
    dequant = 2 * math.prod(shape) * dtype.itemsize if kernel == "dequantize" else 0
    return {"format": fmt, "kernel": kernel, "weight_bytes": weight, "dequant_bytes": dequant}


def pass_traffic(module: nn.Module, device_type: str | None = None) -> dict:
    """Bytes one forward pass of `module` moves through its linear layers (nn.Linear counts as fmt none), by
    kernel: {"formats": {fmt: n}, "kernels": {kernel: n}, "weight_bytes", "dequant_bytes", "bytes"}. Works on
    meta-device modules (give device_type); otherwise the device of the module's tensors. For the planner's
    "what the draft costs per pass" line."""
    if device_type is None:
        tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t is not None]
        device_type = tensors[0].device.type if tensors else "cpu"
    out = {"formats": {}, "kernels": {}, "weight_bytes": 0, "dequant_bytes": 0}
    for sub in module.modules():
        if isinstance(sub, QuantLinear):
            fmt = sub.wmeta["format"] if sub.wmeta is not None else sub.fmt
            t = linear_traffic((sub.out_features, sub.in_features), fmt, sub.dtype, device_type, sub.row_exact,
                               bool(sub.wmeta and sub.wmeta.get("nested_blocksize")))
        elif isinstance(sub, nn.Linear):
            t = linear_traffic((sub.out_features, sub.in_features), "none", sub.weight.dtype, device_type)
        else:
            continue
        out["formats"][t["format"]] = out["formats"].get(t["format"], 0) + 1
        out["kernels"][t["kernel"]] = out["kernels"].get(t["kernel"], 0) + 1
        out["weight_bytes"] += t["weight_bytes"]
        out["dequant_bytes"] += t["dequant_bytes"]
    out["bytes"] = out["weight_bytes"] + out["dequant_bytes"]
    return out


# ----------------------------------------------------------------------------------------- the module

class QuantLinear(nn.Module):
    """nn.Linear whose weight is stored quantized (or plainly, fmt "none") in buffers that bind() re-points.

    forward(x [..., in]) -> [..., out] in x's dtype, through kernel_for(weight format, device, row_exact).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, dtype: torch.dtype,
                 row_exact: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.fmt, self.dtype, self.row_exact = check_format(fmt), dtype, row_exact
        self.wmeta: dict | None = None
        self._cpu: BoundLinear | None = None       # the CPU kernel with this weight's pointers (first forward)
        for attr in _BUFFERS.values():
            self.register_buffer(attr, None, persistent=False)
        self.register_buffer("bias", None, persistent=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"fmt={self.fmt}, dtype={dtype_name(self.dtype)}" + ("" if self.row_exact else ", row_exact=False"))

    def parts(self) -> dict[str, torch.Tensor]:
        """{suffix: tensor} of the bound weight (only the parts that are set)."""
        found = {s: getattr(self, a) for s, a in _BUFFERS.items()}
        return {s: t for s, t in found.items() if t is not None}

    def set_parts(self, parts: dict[str, torch.Tensor], wmeta: dict, bias: torch.Tensor | None) -> None:
        """Point the buffers at `parts` ({suffix: tensor}) and `bias`; nothing is copied."""
        if wmeta["format"] not in _ACCEPTS[self.fmt] or wmeta["shape"] != [self.out_features, self.in_features]:
            raise ValueError(f"cannot bind a {wmeta['format']} weight of shape {wmeta['shape']} to {self}")
        if (bias is not None) != self.has_bias:
            raise ValueError(f"{self}: bias {'missing' if self.has_bias else 'unexpected'} in the bound tensors")
        if wmeta["format"] == "int4":
            int4.check_packing(parts[".qdata"], wmeta)
        for suffix, attr in _BUFFERS.items():
            setattr(self, attr, parts.get(suffix))
        self.bias, self.wmeta, self._cpu = bias, wmeta, None

    def _apply(self, fn, recurse: bool = True):        # .to(), .float(), ...: new tensors, new pointers
        self._cpu = None
        return super()._apply(fn, recurse)

    def bind(self, views: dict[str, torch.Tensor], meta: dict, prefix: str) -> None:
        """Point at views["<prefix>.weight*"] / views["<prefix>.bias"] of one unpacked layer; no allocation."""
        wname = f"{prefix}.weight"
        if wname not in meta["weights"]:
            raise KeyError(f"{wname!r} is not a linear weight of this layer (meta has {sorted(meta['weights'])})")
        parts = {s: views[wname + s] for s in PART_SUFFIXES if wname + s in views}
        self.set_parts(parts, meta["weights"][wname], views.get(f"{prefix}.bias"))

    def _bound(self) -> dict:
        if self.wmeta is None:
            raise RuntimeError(f"{self} is not bound to any weights yet (call bind or bind_module first)")
        return self.wmeta

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the stored dtype (a view for fmt none, a new tensor otherwise)."""
        return dequantize(self.parts(), self._bound())

    def kernel(self) -> str:
        """What forward runs for the bound weight on its device (kernel_for)."""
        wmeta = self._bound()
        device = (self.weight if wmeta["format"] == "none" else self.qdata).device
        return kernel_for(wmeta["format"], device.type, self.row_exact)

    def cpu_kernel(self) -> BoundLinear | None:
        """The CPU integer kernel bound to this weight (made once per binding), or None where the weight runs
        another kernel."""
        kernel = self.kernel() if self._cpu is None else None
        if kernel in ("int4-cpu", "int8-cpu"):                   # bias in its own dtype, added by the kernel
            q4 = kernel == "int4-cpu"
            self._cpu = BoundLinear("q4" if q4 else "q8", self.qdata, self.scales_zeros if q4 else self.scale,
                                    self.wmeta.get("group", 0), self.bias)
        return self._cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None:                                  # the CPU integer kernels' fast path
            return self._cpu(x)
        kernel = self.kernel()
        if kernel in ("int4-cpu", "int8-cpu"):                     # first call after a binding
            return self.cpu_kernel()(x)
        rows = x.reshape(-1, self.in_features)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if kernel in ("linear", "dequantize"):
            w = self.dequantize()
            return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)
        if kernel == "bnb-4bit":
            y = _bnb_gemm(rows.contiguous(), self.parts(), self.wmeta, bias)
            return y.view(*x.shape[:-1], self.out_features)
        xb = rows.to(torch.bfloat16).contiguous()                 # the kernels' activation dtype
        y = int4.matmul(xb, self.parts(), self.wmeta) if kernel == "int4pack" else int8.matmul(xb, self.parts())
        y = y.to(x.dtype)                                          # the residual stream keeps its dtype
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, dtype: torch.dtype, double_quant: bool = False,
                    row_exact: bool = True) -> QuantLinear:
        """A QuantLinear owning the quantized copy of `linear`'s weight (on linear's device)."""
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt, dtype, row_exact)
        parts, wmeta = quantize_weight(linear.weight, fmt, dtype, double_quant)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).contiguous()
        q.set_parts(parts, wmeta, bias)
        return q


# ----------------------------------------------------------------------------------------- whole modules

def _replace_linears(module: nn.Module, make) -> None:
    """Replace every nn.Linear child (recursively) by make(linear)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _replace_linears(child, make)


def swap_linears(module: nn.Module, fmt: str, dtype: torch.dtype) -> None:
    """Replace every nn.Linear in `module` by an unbound QuantLinear(fmt, dtype); allocates nothing."""
    check_format(fmt)
    _replace_linears(module, lambda lin: QuantLinear(lin.in_features, lin.out_features, lin.bias is not None,
                                                     fmt, dtype))


def quantize_module(module: nn.Module, fmt: str, dtype: torch.dtype, double_quant: bool = False,
                    row_exact: bool = True) -> None:
    """Quantize `module` in place for resident use: Linear -> QuantLinear owning its weight, the rest cast.
    row_exact=False (a draft) lets CUDA use fused kernels whose rows may depend on the batch (kernel_for)."""
    check_format(fmt)
    _replace_linears(module, lambda lin: QuantLinear.from_linear(lin, fmt, dtype, double_quant, row_exact))
    for name, p in list(module.named_parameters()):
        owner, leaf = _owner(module, name)
        setattr(owner, leaf, nn.Parameter(p.detach().to(dtype), requires_grad=False))


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """(submodule, attribute) for a dotted parameter name like 'mlp.up_proj.weight'."""
    path, _, leaf = dotted.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def bind_module(module: nn.Module, views: dict[str, torch.Tensor], meta: dict) -> None:
    """Point every QuantLinear and every parameter of `module` at one unpacked layer's views; no allocation.

    views: name -> tensor as storage.unpack_layer returns them; meta: the layer meta from quantize_tensors.
    Raises KeyError naming the first tensor the module needs that `views` lacks.
    """
    for path, sub in module.named_modules():
        if isinstance(sub, QuantLinear):
            sub.bind(views, meta, path)
    for name, p in list(module.named_parameters()):
        if name not in views:
            raise KeyError(f"the packed layer has no tensor {name!r} for the module's parameter")
        view = views[name]
        if view.shape != p.shape:
            raise ValueError(f"{name}: packed shape {list(view.shape)} != parameter shape {list(p.shape)}")
        owner, leaf = _owner(module, name)
        setattr(owner, leaf, nn.Parameter(view, requires_grad=False))
