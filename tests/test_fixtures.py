"""The tiny checkpoints are real Hugging Face checkpoints: transformers loads them offline, the tokenizer
round-trips text and applies its chat template, and the draft fixtures relate to the target as promised."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.demo_models import CHAT_TOKENS
from tests.tiny_models import BOS_ID, EOS_ID, OTHER_VOCAB_SIZE, PAD_ID, UNK_ID, VOCAB_SIZE, write_tiny_model

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
        "qwen3": "Qwen3ForCausalLM"}


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def _batch(n: int = 4, t: int = 48, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(len(CHAT_TOKENS) + 4, VOCAB_SIZE, (n, t), generator=gen)


def test_checkpoint_loads_with_transformers(tiny_model: Path) -> None:
    model, tok = _load(tiny_model)
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"][0] == ARCH[cfg["model_type"]]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (64, 4, 2)
    assert cfg["vocab_size"] == len(tok) == VOCAB_SIZE
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        logits = model(_batch()).logits
    assert logits.shape == (4, 48, VOCAB_SIZE) and torch.isfinite(logits).all()
    top1 = logits.softmax(-1).max(-1).values.mean().item()
    assert top1 > 0.3, f"tiny model logits are too flat (mean top-1 probability {top1:.3f})"


def test_config_parses_as_model_args(tiny_model: Path) -> None:
    from specexec.families import model_args

    args = model_args(json.loads((tiny_model / "config.json").read_text()))
    assert (args.vocab_size, args.dim, args.n_heads, args.n_kv_heads, args.head_dim) == (VOCAB_SIZE, 64, 4, 2, 16)
    assert args.eos_token_ids == (EOS_ID,) and args.bos_token_id == BOS_ID
    assert args.sliding_window is None
    name = tiny_model.name
    assert args.tie_word_embeddings == (name == "qwen2_tied")
    assert args.qkv_bias == name.startswith("qwen2")
    assert args.qk_norm == (name == "qwen3")
    assert (args.rope_scaling_dict or {}).get("rope_type") == ("llama3" if name == "llama3" else None)


def test_tied_checkpoint_has_no_separate_head(tiny_qwen2_tied: Path, tiny_qwen2: Path) -> None:
    from safetensors import safe_open

    with safe_open(tiny_qwen2_tied / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    with safe_open(tiny_qwen2 / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys() and "model.layers.0.self_attn.q_proj.bias" in f.keys()
        assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").abs().sum() > 0   # biases are not zero


def test_tokenizer_round_trip(tiny_llama: Path) -> None:
    _, tok = _load(tiny_llama)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    texts = ["Hello, world!", "The draft model proposes a tree.", "  spaces\tand\nnewlines ", "ünïcödé 🙂 √2"]
    for text in texts:
        ids = tok(text).input_ids
        assert ids[0] == BOS_ID and all(0 <= i < VOCAB_SIZE for i in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    assert len(tok("the target model").input_ids) < len("the target model")      # BPE merges happened


def test_chat_template(tiny_llama: Path) -> None:
    _, tok = _load(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1                              # no double BOS
    assert [tok.convert_tokens_to_ids(t) for t in CHAT_TOKENS] == [4, 5, 6]
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids and ids.count(EOS_ID) == 2


def test_pair_shares_tokenizer_not_weights(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    t_cfg, d_cfg = (json.loads((p / "config.json").read_text()) for p in tiny_pair)
    assert (t_cfg["num_hidden_layers"], d_cfg["num_hidden_layers"]) == (4, 2)
    assert t_cfg["vocab_size"] == d_cfg["vocab_size"]


@pytest.mark.parametrize("pair", ["tiny_pair", "tiny_small_pair"])
def test_perturbed_draft_partially_agrees(pair: str, request: pytest.FixtureRequest) -> None:
    """The perturbed copy of the 4-layer target, and the small pair's (2 layers), each agree with their target
    often but not always: the statistical tests then see accepted and rejected drafts alike."""
    if pair == "tiny_pair":
        target_path = request.getfixturevalue("tiny_pair")[0]
        draft_path = request.getfixturevalue("tiny_perturbed_draft")
    else:
        target_path, draft_path = request.getfixturevalue("tiny_small_pair")
    target, _ = _load(target_path)
    draft, _ = _load(draft_path)
    assert json.loads((draft_path / "config.json").read_text()) == json.loads((target_path / "config.json").read_text())
    x = _batch(8, 64, seed=1)
    with torch.no_grad():
        agree = (target(x).logits.argmax(-1) == draft(x).logits.argmax(-1)).float().mean().item()
    assert 0.5 < agree < 0.95, f"perturbed draft top-1 agreement {agree:.3f} is outside (0.5, 0.95)"


def test_mismatched_draft_tokenizer_disagrees(tiny_llama: Path, tiny_mismatched_draft: Path) -> None:
    _, tok = _load(tiny_llama)
    _, other = _load(tiny_mismatched_draft)
    cfg = json.loads((tiny_mismatched_draft / "config.json").read_text())
    assert cfg["vocab_size"] == len(other) == OTHER_VOCAB_SIZE != len(tok)
    assert other.eos_token_id == cfg["eos_token_id"] != tok.eos_token_id
    assert other.get_vocab() != tok.get_vocab()


def test_writing_is_deterministic(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", "qwen3", seed=3)
    b = write_tiny_model(tmp_path / "b", "qwen3", seed=3)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with pytest.raises(ValueError, match="perturb"):
        write_tiny_model(tmp_path / "c", perturb=0.1)
    with pytest.raises(ValueError, match="family"):
        write_tiny_model(tmp_path / "d", "gpt2")


@pytest.mark.gpu
def test_gpu_marker_only_runs_with_cuda() -> None:
    assert torch.cuda.is_available()
