"""AWQ and GPTQ checkpoints (offload/formats/awq_gptq.py through specexec.checkpoints.loading): tiny fixtures quantized
group-wise to int4 in the test and packed the way AutoAWQ (GEMM, interleaved columns) and AutoGPTQ (v1 zeros - 1, sym
and asym, act-order g_idx; GPTQModel's v2 zeros; 8-bit) pack them, with their quantization_config in config.json. The
loaded model's weights and logits equal those of a dense checkpoint holding the dequantized reference weights exactly,
and stay within the 4-bit error of the original model. Unsupported variants fail with a CheckpointError naming them and
what is supported.

The packers (tests/offload/formats/awq_gptq_writer.py) follow the writers' own loops (AutoAWQ WQLinear_GEMM.from_linear,
AutoGPTQ QuantLinear.pack), independent of the vectorised unpacking under test.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.formats.awq_gptq import PackedCheckpoint, PackedLinear, QuantScheme, parse_quant_config
from offload.formats.checkpoint import CheckpointError
from offload.formats.sources import detect_format, open_source
from specexec.checkpoints.loading import load_model
from tests.offload.formats.awq_gptq_writer import VARIANTS, write_packed

T = 24


def _logits(model) -> torch.Tensor:
    tokens = torch.randint(7, model.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.logits(model(tokens, torch.arange(T).expand(2, -1))).view(2, T, -1)


# ------------------------------------------------------------------------------------------ correctness

@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_equals_dequantized_reference_exactly(name: str, tiny_qwen2: Path, tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases pass through): weights and logits bit-identical to the dense reference."""
    v = VARIANTS[name]
    packed, dense = write_packed(tiny_qwen2, tmp_path, v)
    assert detect_format(packed) == v.method and open_source(packed).format == v.method
    ours, ref = load_model(packed, "cpu", "float32"), load_model(dense, "cpu", "float32")
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert torch.equal(_logits(ours), _logits(ref))


@pytest.mark.parametrize("name,bound", [("awq", 0.6), ("gptq-sym", 0.6), ("gptq-act-order", 0.6), ("gptq-8bit", 0.05)])
def test_packed_is_within_the_quantization_error_of_the_original(name: str, bound: float, tiny_llama: Path,
                                                                 tmp_path: Path) -> None:
    """Every weight is within one quantization step (its group's scale) of the original; the logits' relative
    RMS error stays below `bound` (random weights with std 0.2 through peaked logits are the worst case for
    4-bit: measured 0.39-0.43 at group 32, 0.026 at 8 bits)."""
    packed, _ = write_packed(tiny_llama, tmp_path, VARIANTS[name])
    src, original = PackedCheckpoint(packed), load_file(tiny_llama / "model.safetensors")
    for weight in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        parts = src.packed(weight)
        groups = parts["g_idx"].long() if "g_idx" in parts else torch.arange(src.shape(weight)[1]) // 32
        step = parts["scales"].float()[groups].t()                    # [out, in]
        assert ((src.get(weight) - original[weight]).abs() <= step * (1 + 1e-3)).all(), weight
    got, want = _logits(load_model(packed, "cpu", "float32")), _logits(load_model(tiny_llama, "cpu", "float32"))
    rel = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert 0 < rel < bound, rel


def test_source_shapes_names_and_dtypes(tiny_llama: Path, tmp_path: Path) -> None:
    packed, _ = write_packed(tiny_llama, tmp_path, VARIANTS["gptq-asym"])
    src = PackedCheckpoint(packed)
    names = src.names()
    assert "model.layers.0.mlp.down_proj.weight" in names and not any(n.endswith((".qweight", ".g_idx")) for n in names)
    assert src.shape("model.layers.0.mlp.down_proj.weight") == (64, 128)
    assert src.shape("model.layers.0.self_attn.k_proj.weight") == (32, 64)
    assert src.dtype("model.layers.0.mlp.down_proj.weight") == torch.float32
    assert src.dtype("model.norm.weight") == torch.float32
    assert src.get("model.layers.0.mlp.down_proj.weight").shape == (64, 128)


def test_packed_linear_dequantizes_per_forward(tiny_llama: Path, tmp_path: Path) -> None:
    """The keep-packed option: PackedLinear(x) == F.linear(x, dense weight)."""
    packed, dense = write_packed(tiny_llama, tmp_path, VARIANTS["awq"])
    src = PackedCheckpoint(packed)
    name = "model.layers.1.mlp.up_proj.weight"
    layer = PackedLinear(src.scheme, src.packed(name))
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.linear(x, load_file(dense / "model.safetensors")[name])
    assert torch.equal(layer(x), want)


def test_autogptq_quantize_config_json_is_recognised(tiny_llama: Path, tmp_path: Path) -> None:
    """Older AutoGPTQ checkpoints keep the scheme in quantize_config.json, not in config.json."""
    packed, dense = write_packed(tiny_llama, tmp_path, VARIANTS["gptq-sym"])
    cfg = json.loads((packed / "config.json").read_text())
    (packed / "quantize_config.json").write_text(json.dumps({k: v for k, v in cfg.pop("quantization_config").items()
                                                             if k != "quant_method"}))
    (packed / "config.json").write_text(json.dumps(cfg))
    assert detect_format(packed) == "gptq"
    assert torch.equal(_logits(load_model(packed, "cpu", "float32")), _logits(load_model(dense, "cpu", "float32")))


# ------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("config,pattern", [
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported; supported: awq .*gptq"),
    ({"quant_method": "compressed-tensors"}, r"quant_method 'compressed-tensors' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, r"AWQ version 'gemv' is not supported; supported: gemm"),
    ({"quant_method": "awq", "zero_point": False}, r"AWQ without zero points"),
    ({"quant_method": "awq", "bits": 8}, r"AWQ with 8 bits is not supported; supported: 4"),
    ({"quant_method": "gptq", "bits": 3}, r"GPTQ with 3 bits is not supported; supported: 2, 4, 8"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "gptq", "dynamic": {"-:.*mlp": {}}}, r"'dynamic' overrides are not supported"),
    ({"quant_method": "gptq", "group_size": 0}, r"group_size 0 is invalid"),
])
def test_unsupported_schemes_are_named(config: dict, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        parse_quant_config(config, "ckpt")


def test_act_order_scheme_is_described() -> None:
    scheme = parse_quant_config({"quant_method": "gptq", "desc_act": True, "sym": False}, "ckpt")
    assert scheme == QuantScheme("gptq", 4, 128, zero_offset=1, desc_act=True)
    assert scheme.describe() == "gptq 4-bit group 128 act-order"


def test_broken_packed_tensors_are_named(tiny_llama: Path, tmp_path: Path) -> None:
    packed, _ = write_packed(tiny_llama, tmp_path, VARIANTS["gptq-act-order"])
    tensors = load_file(packed / "model.safetensors")
    prefix = "model.layers.0.mlp.up_proj"
    bad = dict(tensors)
    bad[f"{prefix}.g_idx"] = torch.full_like(tensors[f"{prefix}.g_idx"], 99)
    save_file(bad, packed / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.g_idx holds groups 99..99, the scales have 2"):
        load_model(packed)
    bad = dict(tensors)
    bad[f"{prefix}.scales"] = tensors[f"{prefix}.scales"][:1]
    save_file(bad, packed / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.scales has shape \[1, 128\]; a gptq 4-bit group 32 "
                                              r"act-order linear of \[128, 64\] needs \[2, 128\]"):
        load_model(packed)
    bad = dict(tensors)
    del bad[f"{prefix}.qzeros"]
    save_file(bad, packed / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"up_proj.qweight has no model.layers.0.mlp.up_proj.qzeros"):
        load_model(packed)


def test_unsupported_method_fails_at_load(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match=r"quant_method 'fp8' is not supported"):
        load_model(path)
