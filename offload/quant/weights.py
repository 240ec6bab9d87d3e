"""Quantization of decoder-layer weights as plain tensors plus json-able metadata: bitsandbytes' NF4/FP4
(blockwise 4-bit), int4 (group-wise, offload/quant/int4.py) and int8 (per channel, offload/quant/int8.py) in the
layouts of their integer kernels (cpu_kernels/ on a CPU, torch's on CUDA), or none. A quantized layer
packs into one storage buffer (offload.streaming.storage); the module that computes with it is
offload/quant/linear.py.

Does not know: model architectures beyond "2-D weights of nn.Linear", kernels, modules, tokens, offloading, files.

CONTRACT (used by storage/cache, offload/quant/linear.py and specexec/runtime/offloaded.py):

    FORMATS = ("none", "nf4", "fp4", "int8", "int4")

    def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                         linear_names: set[str] | frozenset[str], double_quant: bool = False,
                         search: str = "default") -> tuple[dict[str, torch.Tensor], dict]
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
                          "<w>.scales_zeros" bfloat16 [out, in/G, 2] on CPU, [in/G, out, 2] on CUDA (group G,
                          default 64)
                          A weight the int4 kernels cannot take (out % 16 or in % 32 nonzero) is stored as int8;
                          its weight meta says "format": "int8".
        (double_quant applies to nf4/fp4 only and is ignored otherwise.)
        meta = {"format": fmt, "dtype": "bfloat16", "double_quant": bool,
                "weights": {"<w>": {"format", "shape": [out, in], "dtype", "blocksize"? (nf4/fp4),
                                    "nested_blocksize"?, "scheme"? (int8), "group", "packing",
                                    "inner_k_tiles"? (int4)}}}
        Non-linear tensors keep their names; every key of `tensors` is either kept or replaced as above.

    Lower level, also public:
    quantize_weight(weight [out, in], fmt, dtype, double_quant=False, group=64, search="default")
        -> ({suffix: tensor}, weight meta); search: int4's range search (int4.SEARCHES)
    dequantize(parts: {suffix: tensor}, weight meta) -> [out, in] in meta's dtype (int4 on CUDA: bf16-rounded)
    weight_specs(shape, fmt, dtype, double_quant=False, device="cpu") / layer_specs(specs, fmt, dtype,
        linear_names, double_quant=False, device="cpu"): what quantize_weight / quantize_tensors produce on
        `device`, as {name: (dtype, shape)} + meta, without quantizing (packed sizes for the planner, synthetic
        layers and the cache's disk-space check).
    packing(fmt, device) -> str | None: what besides the format decides the packed bytes (int4: the kernel's
        layout on that device; int8: its scheme); part of the layer cache's key.
    auto_format(device) -> "int4" on a CPU, "nf4" on CUDA: what --quant auto streams.
    head_format(layer_fmt, device) -> "int8" | "none": the LM head's format beside such layers.
    Tensors are quantized on the device they are on (CUDA is far faster than bitsandbytes' CPU path).
"""
from __future__ import annotations

import functools
import logging

import torch

from offload.quant import FORMATS, int4
from offload.quant import int8

AUTO_FORMAT = {"cpu": "int4", "cuda": "nf4"}     # what --quant auto streams, per device type
BLOCKSIZE = 64                 # NF4/FP4 blocksize (bitsandbytes' default for 4-bit)
NESTED_BLOCKSIZE = 256         # bitsandbytes' fixed blocksize for double-quantized absmax
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def bnb_functional():
    """bitsandbytes.functional, imported lazily (only needed once a weight is (de)quantized), set up once."""
    # bitsandbytes' CPU backend tries at import to fetch an optional hub kernel for its own 4-bit GEMV (through
    # the `kernels` package) and warns when it is missing, untrusted or offline; this module never calls that
    # kernel (it dequantizes and runs F.linear), so both packages' warnings are noise here.
    for name in ("bitsandbytes.backends.cpu.ops", "kernels"):
        logging.getLogger(name).setLevel(logging.ERROR)
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
    """The format --quant auto gives streamed layers: int4 on a CPU (the integer kernel reads 4 bits a weight
    and multiplies them with int8 activations), nf4 on CUDA (bitsandbytes, dequantized while the next layer copies)."""
    return AUTO_FORMAT.get(torch.device(device).type, "nf4")


def head_format(layer_fmt: str, device: torch.device | str) -> str:
    """The LM head's format for a model whose decoder layers are `layer_fmt` on `device`: int8 (per channel,
    the CPU integer kernel) where the layers run the CPU integer kernels (int4, int8), else none (the run
    dtype). A small model's head is the largest single read of its decode step (151,936 x 1,536 in fp32 is
    0.93 GB, int8 0.23 GB)."""
    return "int8" if check_format(layer_fmt) in ("int4", "int8") and torch.device(device).type == "cpu" else "none"


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
                    group: int = int4.DEFAULT_GROUP, search: str = "default") -> tuple[dict[str, torch.Tensor], dict]:
    """One 2-D weight [out, in] -> ({suffix: tensor}, meta); suffix "" for fmt none, else ".qdata" etc.
    group: int4's group size (32, 64 or 128; a smaller one is used where `in` is not a multiple); search: how hard
    int4 seeks each group's range (int4.SEARCHES: "default", "quality"; other formats ignore it)."""
    check_format(fmt)
    if weight.dim() != 2:
        raise ValueError(f"only 2-D linear weights can be quantized, got shape {list(weight.shape)}")
    fmt = _weight_format(fmt, tuple(weight.shape))
    meta = {"format": fmt, "shape": list(weight.shape), "dtype": dtype_name(dtype)}
    if fmt in ("int4", "int8"):
        parts, extra = int4.quantize(weight, group, search) if fmt == "int4" else int8.quantize(weight)
        return parts, {**meta, **extra}
    w = weight.detach().to(dtype).contiguous()
    if fmt == "none":
        return {"": w}, meta
    bnbf = bnb_functional()
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
                     linear_names: set[str] | frozenset[str], double_quant: bool = False, search: str = "default"
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's tensors -> (flat tensors, meta) for storage.pack_layer, packed for the tensors' device; see
    the module docstring (search: quantize_weight's)."""
    check_format(fmt)
    missing = sorted(set(linear_names) - set(tensors))
    if missing:
        raise ValueError(f"linear weight {missing[0]!r} is not among the layer's tensors")
    out: dict[str, torch.Tensor] = {}
    weights: dict[str, dict] = {}
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    for name, t in tensors.items():
        if name in linear_names:
            parts, weights[name] = quantize_weight(t, fmt, dtype, dq, search=search)
            out.update({name + suffix: v.contiguous() for suffix, v in parts.items()})
        else:
            out[name] = (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous()
    return out, {"format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "weights": weights}


def dequantize(parts: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    """The weight [out, in] in meta's dtype (int4 on CUDA: the kernel's values rounded to bf16), from its parts
    ({suffix: tensor} as quantize_weight returns them)."""
    fmt, dtype = meta["format"], parse_dtype(meta["dtype"])
    if fmt == "none":
        return parts[""]
    if fmt == "int8":
        return int8.dequantize(parts, dtype)
    if fmt == "int4":
        int4.check_packing(parts[".qdata"], meta)
        return int4.dequantize(parts, meta).to(dtype)
    bnbf = bnb_functional()
    state2 = None
    if ".nested_absmax" in parts:
        state2 = bnbf.QuantState(absmax=parts[".nested_absmax"], code=parts[".nested_code"],
                                 blocksize=meta["nested_blocksize"], dtype=torch.float32)
    state = bnbf.QuantState(absmax=parts[".absmax"], shape=torch.Size(meta["shape"]), code=parts[".code"],
                            blocksize=meta["blocksize"], quant_type=fmt, dtype=dtype,
                            offset=parts.get(".nested_offset"), state2=state2)
    return bnbf.dequantize_4bit(parts[".qdata"], state)
