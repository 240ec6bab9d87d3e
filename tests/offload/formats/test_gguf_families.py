"""GGUF files of Gemma 2, Gemma 3 (text, and a multimodal checkpoint's text decoder), Phi-3 (partial rotary,
LongRoPE), GLM-4.5 and MiniMax-M2 (their routers, shared experts, next-token-prediction layer), DeepSeek-V3 (latent
attention, kv_b_proj split or whole) written with tests/offload/formats/gguf_writer.py (llama.cpp's names, Gemma's shifted norms, Phi-3's rope factor
tensors and metadata) read back as the same ModelArgs and the same fp32 logits as transformers' model of the
checkpoint they came from. The tiny checkpoints keep what GGUF cannot say at llama.cpp's values:
query_pre_attn_scalar = head_dim, Gemma 3's five sliding layers to one global."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from offload.formats.gguf import GGUFCheckpoint  # noqa: E402
from specexec.checkpoints.loading import load_model, read_args  # noqa: E402
from tests.offload.formats.gguf_writer import write_gguf  # noqa: E402
from tests.tiny_models import LONGROPE, write_tiny_model  # noqa: E402

PATTERN6 = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)]
CASES = {
    "gemma2": ("gemma2", 2, {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}),
    "gemma3": ("gemma3", 6, {"query_pre_attn_scalar": 16, "layer_types": PATTERN6, "tie_word_embeddings": True}),
    "gemma3_mm": ("gemma3_mm", 6, {"query_pre_attn_scalar": 16, "layer_types": PATTERN6}),
    "phi3_long": ("phi3", 2, {"rope_scaling": LONGROPE, "original_max_position_embeddings": 16,
                              "max_position_embeddings": 64}),
}
FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "tie_word_embeddings", "layer_types",
          "sliding_window", "rope_theta", "local_rope_theta", "attn_scale", "attn_softcap", "logit_softcap",
          "rope_dim", "fused_qkv", "embed_scale", "sandwich_norms", "qk_norm")


def assert_same_logits(path: Path, hf_dir: Path, n: int, hf_class: str | None = None) -> None:
    """fp32 logits of n random ids: what specexec reads from the GGUF file = transformers' model of hf_dir."""
    import transformers

    ours = load_model(path, "cpu", "float32")
    ids = torch.randint(7, 300, (1, n), generator=torch.Generator().manual_seed(0))
    cls = getattr(transformers, hf_class or "AutoModelForCausalLM")
    ref = cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(ours.logits(ours(ids, torch.arange(n)[None])), ref(input_ids=ids).logits[0],
                                   atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_family_gguf_reads_back_the_model(case: str, tmp_path: Path) -> None:
    family, layers, overrides = CASES[case]
    hf_dir = write_tiny_model(tmp_path / case, family, seed=40, n_layers=layers, **overrides)
    path = write_gguf(hf_dir, tmp_path / f"{case}.gguf", "F32")
    want, got = read_args(hf_dir), read_args(path)
    assert [getattr(got, f) for f in FIELDS] == [getattr(want, f) for f in FIELDS]
    g, w = got.rope_scaling_dict or {}, want.rope_scaling_dict or {}
    assert sorted(g) == sorted(w)
    for key in w:                                            # GGUF keeps f32 values
        assert torch.allclose(torch.tensor(g[key], dtype=torch.float64), torch.tensor(w[key], dtype=torch.float64),
                              rtol=1e-7) if not isinstance(w[key], str) else g[key] == w[key], key
    src = GGUFCheckpoint(path)
    own = "blk.0.post_ffw_norm.weight" if family.startswith("gemma") else "blk.0.attn_qkv.weight"
    assert own in src._raw
    assert_same_logits(path, hf_dir, 24, "Gemma3ForConditionalGeneration" if case == "gemma3_mm" else None)


MOE_CASES = {"glm4_moe": 3, "minimax_m2": 2}          # the tiny shapes of tests/tiny_models.MOE_SHAPES
MOE_FIELDS = FIELDS + ("qkv_bias", "qk_norm_per_head", "moe", "mtp_layers")


@pytest.mark.parametrize("family", list(MOE_CASES))
def test_moe_family_gguf_reads_back_the_model(family: str, tmp_path: Path) -> None:
    """GLM-4.5 (shared experts, the router's score bias, groups, scale, dense first layer, partial rotary, q/k norms,
    q/k/v biases, and its next-token-prediction layer counted in block_count and left unread) and MiniMax-M2:
    the same ModelArgs and fp32 logits as transformers' model of the checkpoint the file came from."""
    hf_dir = write_tiny_model(tmp_path / family, family, seed=41, n_layers=MOE_CASES[family])
    path = write_gguf(hf_dir, tmp_path / f"{family}.gguf", "F32")
    want, got = read_args(hf_dir), read_args(path)
    assert [getattr(got, f) for f in MOE_FIELDS] == [getattr(want, f) for f in MOE_FIELDS]
    assert_same_logits(path, hf_dir, 24)


LATENT_FIELDS = tuple(f for f in MOE_FIELDS if f != "mtp_layers") + ("latent", "attn_scale")


@pytest.mark.parametrize("split", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek2_gguf_reads_back_the_model(split: bool, tmp_path: Path) -> None:
    """DeepSeek-V3 as llama.cpp writes it (one KV head of the latent width, kv_b_proj as attn_k_b transposed and
    attn_v_b; or, as older files, whole with the per-head widths), its next-token-prediction layer dropped, YaRN
    with mscale = mscale_all_dim (GGUF keeps one of them): the same ModelArgs and fp32 logits as transformers."""
    hf_dir = write_tiny_model(tmp_path / "ds", "deepseek_v3", seed=42, n_layers=2, num_nextn_predict_layers=1,
                              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                   original_max_position_embeddings=128, mscale=1.0,
                                                   mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
    path = write_gguf(hf_dir, tmp_path / "ds.gguf", "F32", split_kv_b=split)
    src = GGUFCheckpoint(path)
    assert ("blk.0.attn_k_b.weight" in src._raw) == split and ("blk.0.attn_kv_b.weight" in src._raw) != split
    want, got = read_args(hf_dir), read_args(path)
    assert [getattr(got, f) for f in LATENT_FIELDS] == [getattr(want, f) for f in LATENT_FIELDS]
    assert (want.mtp_layers, got.mtp_layers) == (1, 0)      # llama.cpp's converter drops the layer
    assert got.rope_scaling_dict == {k: v for k, v in want.rope_scaling_dict.items() if k != "rope_theta"}
    assert_same_logits(path, hf_dir, 40)


def test_a_softmax_gated_deepseek2_file_is_refused_as_deepseek_v2(tmp_path: Path) -> None:
    from offload.formats.checkpoint import CheckpointError

    hf_dir = write_tiny_model(tmp_path / "ds", "deepseek_v3", seed=43, n_layers=2, scoring_func="softmax")
    path = write_gguf(hf_dir, tmp_path / "ds.gguf", "F32")
    with pytest.raises(CheckpointError, match="softmax expert gating is DeepSeek-V2") as err:
        read_args(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["gemma4"])
def test_architectures_not_read_yet_are_one_line(arch: str, tmp_path: Path) -> None:
    import gguf

    from offload.formats.checkpoint import CheckpointError

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=f"GGUF architecture '{arch}' is not supported") as err:
        GGUFCheckpoint(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key, value, needle", [
    ("num_attention_heads", 0, "GGUF metadata minimax-m2.attention.head_count is 0; it must be at least 1"),
    ("num_hidden_layers", 0, "GGUF metadata minimax-m2.block_count 0 is outside [1, 4096]"),
    ("rms_norm_eps", 0.0, "GGUF metadata minimax-m2.attention.layer_norm_rms_epsilon 0.0 is outside (0, 1]"),
])
def test_a_bad_metadata_value_is_one_line_naming_the_gguf_key_and_file(key: str, value, needle: str,
                                                                        tiny_root: Path, tmp_path: Path) -> None:
    """Issue 55: head_count 0 was 'internal error ZeroDivisionError', and a value the config checks refuse was
    named as 'config.json: num_hidden_layers ...' though no config.json exists: the file and its key instead."""
    import json

    from offload.formats.checkpoint import CheckpointError
    from specexec.options import ConfigError

    hf_dir = write_tiny_model(tiny_root / "gguf-bad-meta", "minimax_m2", seed=41, n_layers=2)
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in hf_dir.iterdir():
        (edited / f.name).symlink_to(f)
    (edited / "config.json").unlink()
    (edited / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()), key: value}))
    path = write_gguf(edited, tmp_path / "bad.gguf", "F32")
    with pytest.raises((CheckpointError, ConfigError)) as err:
        read_args(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and needle in msg and "config.json" not in msg and "\n" not in msg, msg


def test_a_gguf_whose_tokenizer_transformers_cannot_build_says_what_works(tiny_root: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """glm4moe (as deepseek2): the weights read, the tokenizer does not (transformers builds no tokenizer of those
    architectures from GGUF metadata yet): one line that says what works and what to run instead (issue 55: the
    README said such files 'load too')."""
    from specexec.options import ConfigError
    from specexec.runtime.tokenizer import load_tokenizer

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    hf_dir = write_tiny_model(tiny_root / "gguf-glm-tok", "glm4_moe", seed=41, n_layers=3)
    path = write_gguf(hf_dir, tmp_path / "glm.gguf", "F32")
    assert read_args(path).moe is not None                                   # the weights' side reads
    try:
        load_tokenizer(path)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and "not supported" in msg and "run this model from its Hugging Face checkpoint" in msg
