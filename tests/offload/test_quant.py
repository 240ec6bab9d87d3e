"""offload.quant.weights and offload.quant.linear: error bounds per format, QuantLinear == F.linear on the dequantized weight for 1 and 64 tokens
(int4/int8: on the int8-quantized activations their CPU kernels compute with), one dequantization per call, bind()
re-targeting without copies, and the size planning helpers. The int4/int8 kernels themselves:
tests/offload/test_quant_kernels.py and tests/cpu_kernels/test_cpu_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels import ops as cpu_ops
from offload.quant import linear as quant
from offload.quant import weights as qweights
from offload.streaming.storage import pack_layer, unpack_layer

# relative Frobenius error of dequant(quant(W)) for W ~ N(0, 1); measured: nf4 0.092, fp4 0.122, int8 (per channel)
# 0.0075, int4 (group 64) 0.0895
BOUNDS = {"nf4": 0.10, "fp4": 0.13, "int8": 0.009, "int4": 0.095, "none": 0.005}
W_SHAPE = (256, 512)
QUANTIZED_ACTS = ("int4", "int8")       # formats whose CPU kernels quantize activations to int8 per block


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", qweights.FORMATS)
def test_dequantized_weight_is_within_the_format_bound(fmt: str, dtype: torch.dtype, double_quant: bool) -> None:
    w = torch.randn(W_SHAPE, generator=torch.Generator().manual_seed(0))
    parts, meta = qweights.quantize_weight(w, fmt, dtype, double_quant)
    d = qweights.dequantize(parts, meta)
    assert d.shape == w.shape and d.dtype == dtype
    bound = 0.0 if fmt == "none" and dtype == torch.float32 else BOUNDS[fmt]
    assert rel_err(d, w) <= bound
    if fmt in ("nf4", "fp4", "int4"):
        assert parts[".qdata"].numel() * parts[".qdata"].element_size() == w.numel() // 2     # 4 bits a weight
        assert (".nested_absmax" in parts) == (double_quant and fmt != "int4")


def test_int4_beats_nf4_beats_fp4_and_int8_beats_all() -> None:
    w = torch.randn(W_SHAPE, generator=torch.Generator().manual_seed(1))
    err = {f: rel_err(qweights.dequantize(*qweights.quantize_weight(w, f, torch.float32)), w)
           for f in ("nf4", "fp4", "int8", "int4")}
    assert err["int8"] < err["int4"] < err["nf4"] < err["fp4"]


def reference_linear(x: torch.Tensor, q: quant.QuantLinear) -> torch.Tensor:
    """What q(x) computes, by another route: F.linear on the dequantized weight (int4/int8: on the activations
    quantized to int8 per block and dequantized, as their CPU kernels see them)."""
    if q.fmt not in QUANTIZED_ACTS:
        return F.linear(x, q.dequantize(), q.bias)
    block = q.wmeta["group"] if q.wmeta["format"] == "int4" else cpu_ops.Q8_BLOCK
    rows = cpu_ops.dequantize_activations(x.reshape(-1, x.shape[-1]), block)
    return F.linear(rows, q.dequantize().float(), q.bias).view(*x.shape[:-1], -1).to(x.dtype)


def assert_same_linear(got: torch.Tensor, want: torch.Tensor, fmt: str) -> None:
    """To fp32 rounding: the kernels sum the same products in another order."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _linear(fmt: str, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> tuple[nn.Linear, quant.QuantLinear]:
    torch.manual_seed(seed)
    lin = nn.Linear(96, 80, bias=bias)
    return lin, quant.QuantLinear.from_linear(lin, fmt, dtype)


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("fmt", qweights.FORMATS)
def test_quantlinear_equals_linear_on_the_dequantized_weight(fmt: str, tokens: int) -> None:
    lin, q = _linear(fmt, torch.float32)
    x = torch.randn(2, tokens, 96)
    y = q(x)
    assert y.shape == (2, tokens, 80) and y.dtype == x.dtype
    assert_same_linear(y, reference_linear(x, q), fmt)
    assert rel_err(y, lin(x)) <= BOUNDS[fmt] + 0.01                       # and close to the original layer


def test_quantlinear_in_bfloat16_without_bias() -> None:
    lin, q = _linear("nf4", torch.bfloat16, bias=False)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantize()))
    assert q(x).dtype == torch.bfloat16


def test_multi_token_input_dequantizes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _, q = _linear("nf4", torch.float32)
    calls = []
    real = qweights.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda parts, meta: calls.append(1) or real(parts, meta))
    q(torch.randn(1, 64, 96))
    assert len(calls) == 1


def _layer(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"proj.weight": torch.randn(80, 96, generator=g), "proj.bias": torch.randn(80, generator=g),
            "norm.weight": torch.randn(96, generator=g)}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(96, elementwise_affine=False)
        self.norm.weight = nn.Parameter(torch.ones(96))
        self.proj = nn.Linear(96, 80)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.norm.weight)


@pytest.mark.parametrize("fmt", qweights.FORMATS)
def test_bind_module_retargets_to_new_views_without_copies(fmt: str) -> None:
    with torch.device("meta"):
        module = Tiny()
    quant.swap_linears(module, fmt, torch.float32)
    assert isinstance(module.proj, quant.QuantLinear)
    x = torch.randn(3, 96)
    outs = []
    for seed in (1, 2):
        tensors, meta = qweights.quantize_tensors(_layer(seed), fmt, torch.float32, {"proj.weight"})
        buf, layout = pack_layer(tensors, meta)
        quant.bind_module(module, unpack_layer(buf, layout), layout.meta)
        start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
        bound = list(module.proj.parts().values()) + [module.proj.bias, module.norm.weight]
        assert all(start <= t.data_ptr() < end for t in bound)             # views of the buffer, no copies
        expect = reference_linear(x * tensors["norm.weight"], module.proj)
        outs.append(module(x))
        assert_same_linear(outs[-1], expect, fmt)
    assert not torch.allclose(outs[0], outs[1])


def test_bind_rejects_a_mismatched_weight() -> None:
    q = quant.QuantLinear(96, 80, True, "nf4", torch.float32)
    with pytest.raises(RuntimeError, match="not bound"):
        q(torch.randn(1, 96))
    tensors, meta = qweights.quantize_tensors(_layer(0), "int8", torch.float32, {"proj.weight"})
    with pytest.raises(ValueError, match="cannot bind"):
        q.bind(tensors, meta, "proj")


def test_quantize_module_for_resident_use() -> None:
    torch.manual_seed(0)
    module = Tiny()
    x = torch.randn(4, 96)
    ref = module(x)
    quant.quantize_module(module, "int8", torch.bfloat16)
    assert isinstance(module.proj, quant.QuantLinear) and module.norm.weight.dtype == torch.bfloat16
    assert rel_err(module(x.bfloat16()), ref) < 0.02


def test_non_linear_tensors_are_cast_and_integers_kept() -> None:
    src = {"w": torch.randn(8, 64), "n": torch.randn(64), "ids": torch.arange(4)}
    out, meta = qweights.quantize_tensors(src, "nf4", torch.bfloat16, {"w"})
    assert out["n"].dtype == torch.bfloat16 and torch.equal(out["ids"], src["ids"])
    assert set(meta["weights"]) == {"w"} and meta["format"] == "nf4" and meta["dtype"] == "bfloat16"


@pytest.mark.parametrize("shape", [(7, 33), (128, 64), (300, 4096)])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("fmt", qweights.FORMATS)
def test_layer_specs_predict_quantize_tensors(fmt: str, double_quant: bool, shape: tuple[int, int]) -> None:
    src = {"a.weight": torch.randn(*shape, dtype=torch.bfloat16), "n.weight": torch.randn(shape[1]),
           "idx": torch.arange(5)}
    tensors, meta = qweights.quantize_tensors(src, fmt, torch.float16, {"a.weight"}, double_quant)
    specs, planned_meta = qweights.layer_specs({k: (v.dtype, tuple(v.shape)) for k, v in src.items()}, fmt,
                                            torch.float16, {"a.weight"}, double_quant)
    assert list(specs.items()) == [(k, (v.dtype, tuple(v.shape))) for k, v in tensors.items()]
    assert planned_meta == meta


def test_bad_arguments_fail_loudly() -> None:
    with pytest.raises(ValueError, match="unknown quantization format 'nf5'"):
        qweights.quantize_tensors({"w": torch.randn(4, 64)}, "nf5", torch.float32, {"w"})
    with pytest.raises(ValueError, match="2-D"):
        qweights.quantize_weight(torch.randn(64), "nf4", torch.float32)
    with pytest.raises(ValueError, match="not among"):
        qweights.quantize_tensors({"w": torch.randn(4, 64)}, "nf4", torch.float32, {"v"})


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", qweights.FORMATS)
def test_cuda_views_bind_and_match_the_cpu_result(fmt: str) -> None:
    """Quantized on the GPU (int4 packs for the device's kernel), packed, copied into a GPU slot in one copy."""
    layer = {k: v.cuda() for k, v in _layer(3).items()}
    tensors, meta = qweights.quantize_tensors(layer, fmt, torch.bfloat16, {"proj.weight"}, double_quant=True)
    buf, layout = pack_layer(tensors, meta)
    slot = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    slot.copy_(buf)                                                        # one copy moves the whole layer
    with torch.device("meta"):
        module = Tiny()
    quant.swap_linears(module, fmt, torch.bfloat16)
    quant.bind_module(module, unpack_layer(slot, layout), layout.meta)
    assert module.proj.parts()[".qdata" if fmt != "none" else ""].device.type == "cuda"
    for tokens in (1, 64):
        x = torch.randn(tokens, 96, dtype=torch.bfloat16)
        w = qweights.dequantize({s: tensors["proj.weight" + s] for s in module.proj.parts()},
                             meta["weights"]["proj.weight"]).cpu()
        cpu = F.linear(x * tensors["norm.weight"].cpu(), w, tensors["proj.bias"].cpu())
        torch.testing.assert_close(module(x.cuda()).cpu(), cpu, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "fp4", "int8", "int4"])
def test_cuda_quantization_is_within_the_same_bound(fmt: str) -> None:
    w = torch.randn(W_SHAPE, generator=torch.Generator().manual_seed(0))
    parts, meta = qweights.quantize_weight(w.cuda(), fmt, torch.float32, double_quant=fmt != "int8")
    assert rel_err(qweights.dequantize(parts, meta).cpu(), w) <= BOUNDS[fmt]
