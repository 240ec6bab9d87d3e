"""Quantization of decoder-layer weights, and a drop-in replacement for nn.Linear that runs on CPU and CUDA:
bitsandbytes' NF4/FP4 (blockwise 4-bit), torch's own int4 (group-wise, offload/quant/int4.py) and int8 (per channel,
offload/quant/int8.py) kernels, or none.

Weights become plain tensors plus json-able metadata, so a quantized layer packs into one storage buffer
(offload.streaming.storage) and a module can be re-pointed at another layer's views without allocating.

Does not know: model architectures beyond "2-D weights of nn.Linear", tokens, offloading, files.

CONTRACT (used by storage/cache and by specexec/runtime/offloaded.py):

    FORMATS = ("none", "nf4", "fp4", "int8", "int4")

    def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                         linear_names: set[str] | frozenset[str], double_quant: bool = False
                         ) -> tuple[dict[str, torch.Tensor], dict]
        Quantize the 2-D weights named in linear_names, cast every other floating tensor to dtype (integer
        tensors are kept as they are). Returns (flat tensors, meta), ready for storage.pack_layer:
          fmt "none":     "<w>"                      dtype [out, in]
          fmt nf4/fp4:    "<w>.qdata"                uint8 [(out*in+1)//2, 1]   two 4-bit codes per byte
                          "<w>.absmax"               float32 [n_blocks] (uint8 with double quant)
                          "<w>.code"                 float32 [16]    the 4-bit code book (informative)
                          with double_quant also "<w>.nested_absmax" float32 [n_blocks/256],
                          "<w>.nested_code" float32 [256], "<w>.nested_offset" float32 [1]
          fmt int8:       "<w>.qdata" int8 [out, in], "<w>.scale" bfloat16 [out]       (per output channel)
          fmt int4:       "<w>.qdata" the codes packed for the int4 kernel of the device the weight was quantized
                          on (uint8 [out, in/2] on CPU, int32 [out/8, in/(16t), 32, t/2] on CUDA),
                          "<w>.scales_zeros" bfloat16 [in/G, out, 2]                   (group G, default 64)
                          A weight the int4 kernels cannot take (out % 16 or in % 32 nonzero) is stored as int8;
                          its weight meta says "format": "int8".
        (double_quant applies to nf4/fp4 only and is ignored otherwise.)
        meta = {"format": fmt, "dtype": "bfloat16", "double_quant": bool,
                "weights": {"<w>": {"format", "shape": [out, in], "dtype", "blocksize"? (nf4/fp4),
                                    "nested_blocksize"?, "scheme"? (int8), "group", "packing",
                                    "inner_k_tiles"? (int4)}}}
        Non-linear tensors keep their names; every key of `tensors` is either kept or replaced as above.

    class QuantLinear(nn.Module):     QuantLinear(in_features, out_features, bias, fmt, dtype, row_exact=True)
        forward(x [..., in]) -> [..., out] in x's dtype, through `kernel_for(format, device, row_exact)`:
            "linear" (fmt none), "dequantize" (the whole weight once per call, any number of tokens, then ONE
            F.linear), "int4pack" / "int8pack" (torch's weight-only kernels: x is cast to bf16 and the result
            back to x's dtype inside the call, so an fp32 residual stream stays fp32), "bnb-4bit" (bitsandbytes'
            4-bit inference GEMM: fused where bitsandbytes' own per-GPU heuristics say so; CUDA draft only).
            row_exact=True (the default, and always for a target) allows only kernels whose result for a row
            does not depend on the batch's other rows.
        bind(views, meta, prefix): point at views["<prefix>.weight*"] and views["<prefix>.bias"] (prefix = the
            module's path inside the layer, e.g. "self_attn.q_proj"; meta = the layer meta from
            quantize_tensors). No tensor is allocated; the pager uses it to re-target a slot module.
        dequantize() -> [out, in] in the stored dtype (int4: the kernel's values, rounded to bf16).
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

    Lower level, also public:
    quantize_weight(weight [out, in], fmt, dtype, double_quant=False, group=64) -> ({suffix: tensor}, weight meta)
    dequantize(parts: {suffix: tensor}, weight meta) -> [out, in] in meta's dtype (int4: bf16-rounded values)
    weight_specs(shape, fmt, dtype, double_quant=False, device="cpu") / layer_specs(specs, fmt, dtype,
        linear_names, double_quant=False, device="cpu"): what quantize_weight / quantize_tensors produce on
        `device`, as {name: (dtype, shape)} + meta, without quantizing (packed sizes for the planner, synthetic
        layers and the cache's disk-space check).
    packing(fmt, device) -> str | None: what besides the format decides the packed bytes (int4: the kernel's
        layout on that device; int8: its scheme); part of the layer cache's key.
    auto_format(device) -> "int4" on a CPU, "nf4" on CUDA: what --quant auto streams.
    kernel_for(fmt, device_type, row_exact=True) -> the kernel a QuantLinear runs (see above).
    pass_traffic(module, device_type=None) -> bytes one forward of `module`'s linears moves, per kernel.
    Tensors are quantized on the device they are on (CUDA is far faster than bitsandbytes' CPU path).

Exactness: every kernel a row-exact QuantLinear runs gives each row a result that depends only on that row and
the packed bytes (torch's int4/int8 kernels accumulate each output on its own in a fixed order: bit for bit for
1..257 rows, tested; dequantize -> F.linear inherits the BLAS's behaviour, whose fp32 rows on a CPU differ in
the last bit for some batch sizes), and never on which tier the bytes came from. Caveat for int4/int8: their
bf16 input and output roundings turn a last-bit difference arriving from elsewhere (CPU attention gives a row
slightly different bits in a tree pass than in a one-token pass) into a bf16-ulp difference, so a greedy
near-tie can (rarely) resolve differently from a one-token decode; the linears themselves add no difference.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from offload.quant import int4
from offload.quant import int8

FORMATS = ("none", "nf4", "fp4", "int8", "int4")
AUTO_FORMAT = {"cpu": "int4", "cuda": "nf4"}     # what --quant auto streams, per device type
BLOCKSIZE = 64                 # NF4/FP4 blocksize (bitsandbytes' default for 4-bit)
NESTED_BLOCKSIZE = 256         # bitsandbytes' fixed blocksize for double-quantized absmax
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def _bnb():
    """bitsandbytes.functional, imported lazily (only needed once a weight is (de)quantized), set up once."""
    # bitsandbytes' CPU backend warns at import that an optional hub kernel for its own 4-bit GEMV is not
    # installed; this module never calls that kernel (it dequantizes and runs F.linear), so the warning is noise.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes.functional as bnbf

    return bnbf


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16 (the json form of a dtype)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for 'bfloat16'; ValueError naming the choices otherwise."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def auto_format(device: torch.device | str) -> str:
    """The format --quant auto gives streamed layers: int4 on a CPU (torch's fused kernel reads 4 bits a weight
    and dequantizes in registers), nf4 on CUDA (bitsandbytes, dequantized while the next layer copies)."""
    return AUTO_FORMAT.get(torch.device(device).type, "nf4")


def packing(fmt: str, device: torch.device | str = "cpu") -> str | None:
    """Besides the format, what decides a layer's packed bytes on `device`: int4's kernel layout, int8's scheme;
    None for the others. Caches key on it so a layout made for another kernel is never read."""
    if check_format(fmt) == "int4":
        return int4.packing(torch.device(device).type)
    return int8.SCHEME if fmt == "int8" else None


def device_problem(fmt: str, device: torch.device | str) -> str | None:
    """One line saying why `fmt` cannot run on `device`, or None."""
    device = torch.device(device)
    if fmt == "int4" and device.type == "cuda":
        return int4.cuda_supported(device)
    return None


# ----------------------------------------------------------------------------------------- quantize

def _weight_format(fmt: str, shape: tuple[int, int]) -> str:
    """The format a weight of `shape` is stored in under layer format fmt (int4 falls back to int8)."""
    return "int8" if fmt == "int4" and not int4.fits(shape) else fmt


def quantize_weight(weight: torch.Tensor, fmt: str, dtype: torch.dtype, double_quant: bool = False,
                    group: int = int4.DEFAULT_GROUP) -> tuple[dict[str, torch.Tensor], dict]:
    """One 2-D weight [out, in] -> ({suffix: tensor}, meta); suffix "" for fmt none, else ".qdata" etc.
    group: int4's group size (32, 64 or 128; a smaller one is used where `in` is not a multiple)."""
    check_format(fmt)
    if weight.dim() != 2:
        raise ValueError(f"only 2-D linear weights can be quantized, got shape {list(weight.shape)}")
    fmt = _weight_format(fmt, tuple(weight.shape))
    meta = {"format": fmt, "shape": list(weight.shape), "dtype": dtype_name(dtype)}
    if fmt in ("int4", "int8"):
        parts, extra = int4.quantize(weight, group) if fmt == "int4" else int8.quantize(weight)
        return parts, {**meta, **extra}
    w = weight.detach().to(dtype).contiguous()
    if fmt == "none":
        return {"": w}, meta
    bnbf = _bnb()
    meta["blocksize"] = BLOCKSIZE
    qdata, state = bnbf.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type=fmt, compress_statistics=double_quant)
    out = {".qdata": qdata, ".absmax": state.absmax, ".code": state.code.float()}
    if state.nested:
        meta["nested_blocksize"] = state.state2.blocksize
        offset = torch.as_tensor(state.offset, dtype=torch.float32).reshape(1)
        out.update({".nested_absmax": state.state2.absmax.float(), ".nested_code": state.state2.code.float(),
                    ".nested_offset": offset})
    return out, meta


def weight_specs(shape: tuple[int, int], fmt: str, dtype: torch.dtype, double_quant: bool = False,
                 device: torch.device | str = "cpu", group: int = int4.DEFAULT_GROUP
                 ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """What quantize_weight returns for a weight of `shape` quantized on `device`, as ({suffix: (dtype, shape)},
    meta), computed without quantizing: packed sizes for planners, synthetic layers and the cache's disk check."""
    check_format(fmt)
    out_f, in_f = (int(s) for s in shape)
    fmt = _weight_format(fmt, (out_f, in_f))
    meta = {"format": fmt, "shape": [out_f, in_f], "dtype": dtype_name(dtype)}
    if fmt in ("int4", "int8"):
        specs, extra = (int4.specs((out_f, in_f), torch.device(device).type, group) if fmt == "int4"
                        else int8.specs((out_f, in_f)))
        return specs, {**meta, **extra}
    if fmt == "none":
        return {"": (dtype, (out_f, in_f))}, meta
    meta["blocksize"] = BLOCKSIZE
    n = out_f * in_f
    blocks = -(-n // BLOCKSIZE)
    f32 = torch.float32
    specs = {".qdata": (torch.uint8, ((n + 1) // 2, 1)), ".absmax": (torch.uint8 if double_quant else f32, (blocks,)),
             ".code": (f32, (16,))}
    if double_quant:
        meta["nested_blocksize"] = NESTED_BLOCKSIZE
        specs.update({".nested_absmax": (f32, (-(-blocks // NESTED_BLOCKSIZE),)), ".nested_code": (f32, (256,)),
                      ".nested_offset": (f32, (1,))})
    return specs, meta


def layer_specs(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], fmt: str, dtype: torch.dtype,
                linear_names: set[str] | frozenset[str], double_quant: bool = False,
                device: torch.device | str = "cpu") -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """quantize_tensors on shapes only: source {name: (dtype, shape)} -> ({packed name: (dtype, shape)}, meta),
    the same names, order and meta that quantize_tensors produces on `device` (storage.plan_layout turns it into
    bytes)."""
    check_format(fmt)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    weights: dict[str, dict] = {}
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    for name, (src_dtype, shape) in specs.items():
        if name in linear_names:
            parts, weights[name] = weight_specs(tuple(shape), fmt, dtype, dq, device)
            out.update({name + suffix: spec for suffix, spec in parts.items()})
        else:
            out[name] = (dtype if src_dtype.is_floating_point else src_dtype, tuple(shape))
    return out, {"format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "weights": weights}


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                     linear_names: set[str] | frozenset[str], double_quant: bool = False
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's tensors -> (flat tensors, meta) for storage.pack_layer, packed for the tensors' device; see
    the module docstring."""
    check_format(fmt)
    missing = sorted(set(linear_names) - set(tensors))
    if missing:
        raise ValueError(f"linear weight {missing[0]!r} is not among the layer's tensors")
    out: dict[str, torch.Tensor] = {}
    weights: dict[str, dict] = {}
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    for name, t in tensors.items():
        if name in linear_names:
            parts, weights[name] = quantize_weight(t, fmt, dtype, dq)
            out.update({name + suffix: v.contiguous() for suffix, v in parts.items()})
        else:
            out[name] = (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous()
    return out, {"format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "weights": weights}


def dequantize(parts: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    """The weight [out, in] in meta's dtype (int4: the kernel's values rounded to bf16), from its parts
    ({suffix: tensor} as quantize_weight returns them)."""
    fmt, dtype = meta["format"], parse_dtype(meta["dtype"])
    if fmt == "none":
        return parts[""]
    if fmt == "int8":
        return int8.dequantize(parts, dtype)
    if fmt == "int4":
        int4.check_packing(parts[".qdata"], meta)
        return int4.dequantize(parts, meta).to(dtype)
    bnbf = _bnb()
    state2 = None
    if ".nested_absmax" in parts:
        state2 = bnbf.QuantState(absmax=parts[".nested_absmax"], code=parts[".nested_code"],
                                 blocksize=meta["nested_blocksize"], dtype=torch.float32)
    state = bnbf.QuantState(absmax=parts[".absmax"], shape=torch.Size(meta["shape"]), code=parts[".code"],
                            blocksize=meta["blocksize"], quant_type=fmt, dtype=dtype,
                            offset=parts.get(".nested_offset"), state2=state2)
    return bnbf.dequantize_4bit(parts[".qdata"], state)


# ----------------------------------------------------------------------------------------- kernels

PART_SUFFIXES = ("", ".qdata", ".absmax", ".code", ".nested_absmax", ".nested_code", ".nested_offset", ".scale",
                 ".scales_zeros")
_BUFFERS = {s: "weight" if s == "" else s[1:] for s in PART_SUFFIXES}   # suffix -> buffer attribute name
_ACCEPTS = {f: {f} for f in FORMATS} | {"int4": {"int4", "int8"}}        # layer format -> weight formats it binds
KERNELS = ("linear", "dequantize", "int4pack", "int8pack", "bnb-4bit")


@functools.cache
def _bnb_gemm_4bit() -> bool:
    """Whether bitsandbytes registers its 4-bit inference GEMM op (bitsandbytes >= 0.48)."""
    _bnb()
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
    if fmt == "int4":
        return "int4pack"
    if fmt == "int8":
        return "int8pack" if device_type == "cpu" or (not row_exact and int8.cuda_kernel()) else "dequantize"
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
        self.bias, self.wmeta = bias, wmeta

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel()
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        if kernel in ("linear", "dequantize"):
            w = self.dequantize()
            return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features)
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
