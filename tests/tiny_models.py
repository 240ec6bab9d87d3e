"""Tiny random-weight Llama-family checkpoints, written as REAL Hugging Face checkpoints for the tests.

Each checkpoint is what `save_pretrained` writes (config.json, model.safetensors, generation_config.json) plus a
byte-level BPE tokenizer built in memory with `tokenizers` (tokenizer.json, tokenizer_config.json and a jinja
chat template), so the real loader, tokenizer wrapper, quantizer and pager run on it and transformers' own
implementation can serve as the reference. Nothing is downloaded.

Weights are deliberately NOT the transformers default init: the std is 0.2 instead of 0.02 and the LM head is
scaled up so next-token distributions are peaked (greedy argmax chains are far from ties, which the fp32
exactness tests rely on), and biases and RMSNorm weights are random instead of 0 and 1, so an implementation
that forgets a bias or a norm weight produces different logits.

Does not know: anything of specexec; it only uses transformers, tokenizers, safetensors and torch.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")            # ids 0, 1, 2, 3 in the default tokenizer
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")       # ids 4, 5, 6: added special tokens
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
VOCAB_SIZE = 320                                                # tokenizer vocab == model vocab_size

# The draft of the tokenizer-mismatch test: other special-token order, other vocabulary size.
OTHER_SPECIAL_TOKENS = ("</s>", "<s>", "<pad>", "<unk>")
OTHER_VOCAB_SIZE = 288

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A draft model proposes a tree of tokens and the target model
checks the whole tree in one pass; the longest path that the target agrees with is emitted.
Speculative decoding keeps the output of the target model exactly: greedy decoding matches token for token,
and sampling keeps the distribution. The weights of the large model live in memory or on a disk and stream
to the accelerator layer by layer, so one pass costs about the same for one token as for a thousand tokens.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a little model that wanted to think faster than the big model it served.
def main(): return sum(x * x for x in range(10))  # numbers 0123456789 and symbols +-*/=<>()[]{}
user: tell me a story. assistant: there once was a tree with many branches, and every branch was a guess.
"""


def _train_tokenizer(special: tuple[str, ...], vocab_size: int, corpus: str) -> "Any":
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` entries (specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special) + list(CHAT_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}; "
                           "the embedded corpus is too small for that many merges")
    bos, eos = "<s>", "</s>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def write_tokenizer(dest: Path, variant: str = "default") -> Path:
    """Write a Llama-style tokenizer (BOS added on encode, chat template) into `dest`; return `dest`.

    variant "default": VOCAB_SIZE entries, <unk>=0 <s>=1 </s>=2 <pad>=3 <|system|>=4 <|user|>=5 <|assistant|>=6.
    variant "other": OTHER_VOCAB_SIZE entries with the specials in another order (ids disagree with "default").
    """
    from transformers import PreTrainedTokenizerFast

    if variant == "default":
        special, size, corpus = SPECIAL_TOKENS, VOCAB_SIZE, CORPUS
    elif variant == "other":
        special, size, corpus = OTHER_SPECIAL_TOKENS, OTHER_VOCAB_SIZE, CORPUS[::-1]
    else:
        raise ValueError(f"unknown tokenizer variant {variant!r}; use 'default' or 'other'")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(special, size, corpus),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=list(CHAT_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(dest)
    return dest


def tokenizer_ids(variant: str = "default") -> dict[str, int]:
    """bos/eos/pad/unk ids of a tokenizer variant, for the model config."""
    special = SPECIAL_TOKENS if variant == "default" else OTHER_SPECIAL_TOKENS
    return {name: special.index(tok) for name, tok in
            (("unk", "<unk>"), ("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"))}


# ---------------------------------------------------------------------------------------------- models

FAMILIES = ("llama", "qwen2", "mistral", "qwen3")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

INIT_STD = 0.2        # transformers' default 0.02 gives near-uniform next-token distributions
HEAD_SCALE = 2.5      # LM head std = INIT_STD * HEAD_SCALE: logits std ~4, top-1 probability ~0.5 on average
DRAFT_PERTURB = 0.01  # relative noise of the perturbed draft: ~78% top-1 agreement with the 4-layer target


def _classes(family: str) -> tuple[type, type]:
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    if family not in table:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    return table[family]


def tiny_config_kwargs(family: str, n_layers: int, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """The shape every tiny model shares: hidden 64, 4 heads of 16, 2 KV heads (GQA), MLP 128, 512 positions."""
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=INIT_STD, tie_word_embeddings=False,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )
    if family == "qwen2":
        kw.update(use_sliding_window=False)
    if family == "qwen3":
        kw.update(use_sliding_window=False, attention_bias=False)
    if family == "mistral":
        kw.update(sliding_window=None)
    return kw


@torch.no_grad()
def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Peaked logits; random biases and norm weights (see the module docstring)."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        elif "norm" in name:                       # input/post-attention/final RMSNorm, Qwen3 q_norm/k_norm
            p.copy_(1.0 + torch.randn(p.shape, generator=generator) * 0.2)
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * INIT_STD)
    head = model.get_output_embeddings().weight
    head.mul_(HEAD_SCALE)                          # when tied this is also the embedding: harmless


def write_tiny_model(dest: Path, family: str = "llama", seed: int = 0, n_layers: int = 2,
                     perturb: float | None = None, base: Path | None = None,
                     tokenizer: str = "default", **config_overrides: Any) -> Path:
    """Write a tiny random float32 checkpoint of `family` into `dest` (created); return `dest`.

    perturb + base: copy the checkpoint at `base` (config, tokenizer and all) and add to every weight tensor
    gaussian noise of std `perturb * rms(tensor)` drawn from `seed` -- a draft that partially agrees with
    `base`. `family`, `n_layers`, `tokenizer` and overrides do not apply then (overrides raise).
    tokenizer: "default" or "other" (see write_tokenizer); the model's vocab_size and bos/eos/pad ids follow it.
    config_overrides: passed to the transformers config class, e.g. rope_scaling=LLAMA3_ROPE,
    tie_word_embeddings=True, num_hidden_layers is `n_layers`.
    """
    dest = Path(dest)
    if perturb is not None or base is not None:
        if perturb is None or base is None:
            raise ValueError(f"perturb ({perturb!r}) and base ({base!r}) go together")
        if config_overrides:
            raise ValueError(f"a perturbed copy keeps the base config; got overrides {sorted(config_overrides)}")
        return _write_perturbed(dest, Path(base), perturb, seed)

    config_cls, model_cls = _classes(family)
    vocab = VOCAB_SIZE if tokenizer == "default" else OTHER_VOCAB_SIZE
    kw = tiny_config_kwargs(family, n_layers, vocab, tokenizer_ids(tokenizer))
    kw.update(config_overrides)
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomize(model, gen)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    write_tokenizer(dest, tokenizer)
    return dest


def _write_perturbed(dest: Path, base: Path, perturb: float, seed: int) -> Path:
    from safetensors.torch import load_file, save_file

    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"base checkpoint {base} has no config.json")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(dest.glob("*.safetensors")):
        tensors = load_file(file)
        for name in sorted(tensors):
            w = tensors[name]
            if w.is_floating_point():
                rms = w.float().pow(2).mean().sqrt()
                tensors[name] = (w + torch.randn(w.shape, generator=gen) * rms * perturb).to(w.dtype).contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
    return dest


def load_pair_models(pair: tuple[Path, Path], perturbed: Path) -> dict:
    """The tiny pair loaded through specexec: target, an unrelated random draft and a perturbed copy."""
    from specexec.runtime.loading import load_model
    return {"target": load_model(pair[0]), "random": load_model(pair[1]), "perturbed": load_model(perturbed)}


def prompt(seed: int, n: int = 14) -> list[int]:
    """A reproducible random prompt of n ordinary token ids."""
    return torch.randint(7, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
