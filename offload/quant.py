"""Quantization of decoder-layer weights with bitsandbytes (NF4, FP4, 8-bit blockwise) or none, and a drop-in
replacement for nn.Linear that runs on CPU and CUDA.

Weights become plain tensors plus json-able metadata, so a quantized layer packs into one storage buffer
(offload.storage) and a module can be re-pointed at another layer's views without allocating.

Does not know: model architectures beyond "2-D weights of nn.Linear", tokens, offloading, files.

CONTRACT (used by storage/cache and by specexec/offloaded.py):

    FORMATS = ("none", "nf4", "fp4", "int8")

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
          fmt int8:       "<w>.qdata" uint8 [out, in], "<w>.absmax" float32 [n_blocks], "<w>.code" float32 [256]
        (double_quant applies to nf4/fp4 only and is ignored for int8/none.)
        meta = {"format": fmt, "dtype": "bfloat16", "double_quant": bool,
                "weights": {"<w>": {"format", "shape": [out, in], "dtype", "blocksize", "nested_blocksize"?}}}
        Non-linear tensors keep their names; every key of `tensors` is either kept or replaced as above.

    class QuantLinear(nn.Module):                 QuantLinear(in_features, out_features, bias, fmt, dtype)
        forward(x [..., in]) -> [..., out]: dequantize the weight ONCE per call (any number of tokens) and run
            one GEMM, F.linear(x, W, b); W is cast to x.dtype if they differ.
        bind(views, meta, prefix): point at views["<prefix>.weight*"] and views["<prefix>.bias"] (prefix = the
            module's path inside the layer, e.g. "self_attn.q_proj"; meta = the layer meta from
            quantize_tensors). No tensor is allocated; the pager uses it to re-target a slot module.
        dequantize() -> [out, in] in the stored dtype.
        from_linear(linear, fmt, dtype, double_quant=False) -> QuantLinear  (classmethod, owns its tensors)

    def swap_linears(module: nn.Module, fmt: str, dtype: torch.dtype) -> None
        Replace every nn.Linear inside `module` by an unbound QuantLinear of format fmt (meta-device friendly:
        nothing is allocated; bind_module fills it).
    def bind_module(module: nn.Module, views: dict[str, torch.Tensor], meta: dict) -> None
        Point every QuantLinear and every remaining parameter of `module` at the views of one unpacked layer
        (names as in module.named_parameters(); quantized weights under their "<name>.*" keys).
    def quantize_module(module: nn.Module, fmt: str, dtype: torch.dtype, double_quant: bool = False) -> None
        Resident use (draft, GPU-resident target layers): swap every nn.Linear for a QuantLinear that owns
        its quantized weight (quantized on the module's device), cast the other parameters to dtype.

    Lower level, also public:
    quantize_weight(weight [out, in], fmt, dtype, double_quant=False) -> ({suffix: tensor}, weight meta)
    dequantize(parts: {suffix: tensor}, weight meta) -> [out, in] in meta's dtype
    weight_specs(shape, fmt, dtype, double_quant=False) / layer_specs(specs, fmt, dtype, linear_names,
        double_quant=False): what quantize_weight / quantize_tensors produce, as {name: (dtype, shape)} + meta,
        without quantizing (packed sizes for the planner, synthetic layers and the cache's disk-space check).
    Tensors are quantized on the device they are on (CUDA is far faster than bitsandbytes' CPU path).

Exactness: on every device the layer runs dequantize -> F.linear, for 1 token as for 4,096, so a layer's output
depends only on its packed bytes and the input, never on which tier the bytes came from.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("none", "nf4", "fp4", "int8")
BLOCKSIZE = 64                 # NF4/FP4 and int8 blocksize (bitsandbytes' default for 4-bit)
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


# ----------------------------------------------------------------------------------------- quantize

def quantize_weight(weight: torch.Tensor, fmt: str, dtype: torch.dtype, double_quant: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """One 2-D weight [out, in] -> ({suffix: tensor}, meta); suffix "" for fmt none, else ".qdata" etc."""
    check_format(fmt)
    if weight.dim() != 2:
        raise ValueError(f"only 2-D linear weights can be quantized, got shape {list(weight.shape)}")
    w = weight.detach().to(dtype).contiguous()
    meta = {"format": fmt, "shape": list(w.shape), "dtype": dtype_name(dtype)}
    if fmt == "none":
        return {"": w}, meta
    bnbf = _bnb()
    meta["blocksize"] = BLOCKSIZE
    if fmt == "int8":
        qdata, state = bnbf.quantize_blockwise(w, blocksize=BLOCKSIZE)
        return {".qdata": qdata, ".absmax": state.absmax.float(), ".code": state.code.float()}, meta
    qdata, state = bnbf.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type=fmt, compress_statistics=double_quant)
    out = {".qdata": qdata, ".absmax": state.absmax, ".code": state.code.float()}
    if state.nested:
        meta["nested_blocksize"] = state.state2.blocksize
        offset = torch.as_tensor(state.offset, dtype=torch.float32).reshape(1)
        out.update({".nested_absmax": state.state2.absmax.float(), ".nested_code": state.state2.code.float(),
                    ".nested_offset": offset})
    return out, meta


def weight_specs(shape: tuple[int, int], fmt: str, dtype: torch.dtype, double_quant: bool = False
                 ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """What quantize_weight returns for a weight of `shape`, as ({suffix: (dtype, shape)}, meta), computed
    without quantizing: packed sizes for planners, synthetic layers and the cache's disk-space check."""
    check_format(fmt)
    out_f, in_f = (int(s) for s in shape)
    meta = {"format": fmt, "shape": [out_f, in_f], "dtype": dtype_name(dtype)}
    if fmt == "none":
        return {"": (dtype, (out_f, in_f))}, meta
    meta["blocksize"] = BLOCKSIZE
    n = out_f * in_f
    blocks = -(-n // BLOCKSIZE)
    f32 = torch.float32
    if fmt == "int8":
        return {".qdata": (torch.uint8, (out_f, in_f)), ".absmax": (f32, (blocks,)), ".code": (f32, (256,))}, meta
    specs = {".qdata": (torch.uint8, ((n + 1) // 2, 1)), ".absmax": (torch.uint8 if double_quant else f32, (blocks,)),
             ".code": (f32, (16,))}
    if double_quant:
        meta["nested_blocksize"] = NESTED_BLOCKSIZE
        specs.update({".nested_absmax": (f32, (-(-blocks // NESTED_BLOCKSIZE),)), ".nested_code": (f32, (256,)),
                      ".nested_offset": (f32, (1,))})
    return specs, meta


def layer_specs(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], fmt: str, dtype: torch.dtype,
                linear_names: set[str] | frozenset[str], double_quant: bool = False
                ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """quantize_tensors on shapes only: source {name: (dtype, shape)} -> ({packed name: (dtype, shape)}, meta),
    the same names, order and meta that quantize_tensors produces (storage.plan_layout turns it into bytes)."""
    check_format(fmt)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    weights: dict[str, dict] = {}
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    for name, (src_dtype, shape) in specs.items():
        if name in linear_names:
            parts, weights[name] = weight_specs(tuple(shape), fmt, dtype, dq)
            out.update({name + suffix: spec for suffix, spec in parts.items()})
        else:
            out[name] = (dtype if src_dtype.is_floating_point else src_dtype, tuple(shape))
    return out, {"format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "weights": weights}


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                     linear_names: set[str] | frozenset[str], double_quant: bool = False
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's tensors -> (flat tensors, meta) for storage.pack_layer; see the module docstring."""
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
    """The weight [out, in] in meta's dtype, from its parts ({suffix: tensor} as quantize_weight returns them)."""
    fmt, dtype = meta["format"], parse_dtype(meta["dtype"])
    if fmt == "none":
        return parts[""]
    bnbf = _bnb()
    if fmt == "int8":
        state = bnbf.QuantState(absmax=parts[".absmax"], code=parts[".code"], blocksize=meta["blocksize"],
                                dtype=dtype)
        return bnbf.dequantize_blockwise(parts[".qdata"], state).view(meta["shape"])
    state2 = None
    if ".nested_absmax" in parts:
        state2 = bnbf.QuantState(absmax=parts[".nested_absmax"], code=parts[".nested_code"],
                                 blocksize=meta["nested_blocksize"], dtype=torch.float32)
    state = bnbf.QuantState(absmax=parts[".absmax"], shape=torch.Size(meta["shape"]), code=parts[".code"],
                            blocksize=meta["blocksize"], quant_type=fmt, dtype=dtype,
                            offset=parts.get(".nested_offset"), state2=state2)
    return bnbf.dequantize_4bit(parts[".qdata"], state)


# ----------------------------------------------------------------------------------------- the module

PART_SUFFIXES = ("", ".qdata", ".absmax", ".code", ".nested_absmax", ".nested_code", ".nested_offset")
_BUFFERS = {s: "weight" if s == "" else s[1:] for s in PART_SUFFIXES}   # suffix -> buffer attribute name


class QuantLinear(nn.Module):
    """nn.Linear whose weight is stored quantized (or plainly, fmt "none") in buffers that bind() re-points.

    forward(x [..., in]) -> [..., out]: one dequantization per call, then one F.linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.fmt, self.dtype = check_format(fmt), dtype
        self.wmeta: dict | None = None
        for attr in _BUFFERS.values():
            self.register_buffer(attr, None, persistent=False)
        self.register_buffer("bias", None, persistent=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"fmt={self.fmt}, dtype={dtype_name(self.dtype)}")

    def parts(self) -> dict[str, torch.Tensor]:
        """{suffix: tensor} of the bound weight (only the parts that are set)."""
        found = {s: getattr(self, a) for s, a in _BUFFERS.items()}
        return {s: t for s, t in found.items() if t is not None}

    def set_parts(self, parts: dict[str, torch.Tensor], wmeta: dict, bias: torch.Tensor | None) -> None:
        """Point the buffers at `parts` ({suffix: tensor}) and `bias`; nothing is copied."""
        if wmeta["format"] != self.fmt or wmeta["shape"] != [self.out_features, self.in_features]:
            raise ValueError(f"cannot bind a {wmeta['format']} weight of shape {wmeta['shape']} to {self}")
        if (bias is not None) != self.has_bias:
            raise ValueError(f"{self}: bias {'missing' if self.has_bias else 'unexpected'} in the bound tensors")
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

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the stored dtype (a view for fmt none, a new tensor otherwise)."""
        if self.wmeta is None:
            raise RuntimeError(f"{self} is not bound to any weights yet (call bind or bind_module first)")
        return dequantize(self.parts(), self.wmeta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantize()
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return F.linear(x, w, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, dtype: torch.dtype, double_quant: bool = False) -> QuantLinear:
        """A QuantLinear owning the quantized copy of `linear`'s weight (on linear's device)."""
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt, dtype)
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


def quantize_module(module: nn.Module, fmt: str, dtype: torch.dtype, double_quant: bool = False) -> None:
    """Quantize `module` in place for resident use: Linear -> QuantLinear owning its weight, the rest cast."""
    check_format(fmt)
    _replace_linears(module, lambda lin: QuantLinear.from_linear(lin, fmt, dtype, double_quant))
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
