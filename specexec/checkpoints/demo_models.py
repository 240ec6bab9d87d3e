"""Small random-weight Llama-family checkpoints written as REAL Hugging Face checkpoints (for `specexec demo`,
and usable by tests): config.json + model.safetensors via transformers' own classes, plus a byte-level BPE
tokenizer trained in memory with `tokenizers` (tokenizer.json, tokenizer_config.json, a jinja chat template).

Weights are not transformers' default init (which gives near-uniform next-token distributions): the std is
larger and the LM head is scaled so next tokens are peaked, and biases / norm weights are random. A draft is
the target plus relative gaussian noise, so it agrees with the target often but not always.

The test fixtures (tests/tiny_models.py) build their smaller models from these same pieces.

Does not know: the specexec runtime; it only writes files. Nothing is downloaded.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")              # ids 0..3
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")         # ids 4..6
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# The demo pair's template (`specexec demo`): the same turns, plus tools in the hermes format (Qwen's
# <tool_call>{"name", "arguments"}</tool_call>), so `specexec serve --model demo` can be tried with tools.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nCall a function as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    "</tool_call>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.tool_calls %}<|assistant|>\n"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{{ eos_token }}\n"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}{% endif %}"
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
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "gemma3_mm", "phi3", "qwen3_moe", "qwen2_moe",
            "mixtral", "olmoe", "gpt_oss", "glm4_moe", "minimax_m2",
            "qwen3_next", "qwen3_5", "qwen3_5_mm", "qwen3_5_moe", "deepseek_v3",
            "gemma4", "gemma4_mm", "gemma4_moe")
LEARNED_BUFFERS = ("e_score_correction_bias", "layer_scalar")   # stored buffers `randomize` fills too
# ... of a tiny multimodal Gemma 4 (`gemma4_mm`), likewise
TINY_VISION4 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=1)
# The vision tower of a tiny multimodal Gemma 3 (`gemma3_mm`): present in the checkpoint, never run by specexec.
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


def train_tokenizer(vocab_size: int, corpus: str = CORPUS, special: tuple[str, ...] = SPECIAL_TOKENS) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` (specials first, then CHAT_TOKENS; BOS added on encode) of at
    most vocab_size entries: a small corpus allows only so many merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special) + list(CHAT_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1,
                                  show_progress=False)
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def save_tokenizer(dest: Path, tok: Any, max_length: int = 2048, chat_template: str = CHAT_TEMPLATE) -> None:
    """Write a trained tokenizer into `dest` as transformers saves it, with the chat template."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=list(CHAT_TOKENS), chat_template=chat_template, model_max_length=max_length,
        clean_up_tokenization_spaces=False)
    Path(dest).mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(dest)


def write_tokenizer(dest: Path, vocab_size: int = 320, corpus: str = CORPUS,
                    special: tuple[str, ...] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE) -> int:
    """Train a Llama-style tokenizer (train_tokenizer) into `dest`; return its size."""
    tok = train_tokenizer(vocab_size, corpus, special)
    save_tokenizer(dest, tok, chat_template=chat_template)
    return tok.get_vocab_size()


def model_classes(family: str) -> tuple[Any, type]:
    """(config factory taking the decoder's config kwargs, transformers model class) of a family; gemma3_mm is
    the multimodal Gemma3ForConditionalGeneration (the kwargs become its text_config, with a tiny vision tower)."""
    import transformers as tf

    def wrapped(config: Any, tie: bool, **parts: Any) -> Any:
        """A multimodal config whose text_config is the decoder's kwargs (ids and tying lifted to the top)."""
        def make(**kw: Any) -> Any:
            ids = {k: kw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in kw}
            vision = parts.get("vision_config")
            vision = vision(kw) if callable(vision) else vision
            return config(text_config=kw, **{**parts, "vision_config": vision},
                          tie_word_embeddings=kw.get("tie_word_embeddings", tie), **ids)
        return make

    multimodal = wrapped(tf.Gemma3Config, True, vision_config=TINY_VISION, mm_tokens_per_image=1)
    qwen3_5_mm = wrapped(tf.Qwen3_5Config, False, vision_config=lambda kw: dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=kw["hidden_size"], patch_size=14,
        spatial_merge_size=1, temporal_patch_size=1))
    gemma4_multimodal = wrapped(tf.Gemma4Config, True, vision_config=TINY_VISION4, audio_config=None)

    table = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
             "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
             "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
             "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
             "gemma3_mm": (multimodal, tf.Gemma3ForConditionalGeneration),
             "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
             "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
             "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM), "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
             "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
             "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
             "minimax_m2": (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM),
             "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
             "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
             "qwen3_5_mm": (qwen3_5_mm, tf.Qwen3_5ForConditionalGeneration),
             "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
             "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
             "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM),
             "gemma4_moe": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM),
             "gemma4_mm": (gemma4_multimodal, tf.Gemma4ForConditionalGeneration)}

    if family not in table:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    return table[family]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float, head_scale: float) -> None:
    """Peaked logits; random biases and norm weights (see the module docstring). Weights get std `std`, then
    the LM head is multiplied by head_scale; learned scales get 1 + std 0.2, the learned buffers (LEARNED_BUFFERS: a
    router's score bias, around 0; a layer's scalar, around 1) std 0.2, so a checkpoint read without them would
    compute another function."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "norm" in name or name.endswith("scale"):           # norms and learned scales around 1
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in model.named_buffers():         # learned values stored as buffers (a router's score bias)
        if name.endswith(LEARNED_BUFFERS):
            b.copy_((1.0 if name.endswith("scalar") else 0.0) + torch.randn(b.shape, generator=gen) * 0.2)
    head = model.get_output_embeddings().weight
    head.mul_(head_scale)                          # when tied this is also the embedding: harmless


def write_model(dest: Path, family: str = "llama", seed: int = 0, n_layers: int = 4, hidden: int = 256,
                n_heads: int = 4, n_kv_heads: int = 2, intermediate: int = 688, vocab_size: int = 320,
                std: float | None = None, head_scale: float = 1.0, chat_template: str = CHAT_TEMPLATE,
                **config_overrides: Any) -> Path:
    """Write a random float32 checkpoint with its tokenizer (and `chat_template`) into `dest`; return `dest`.

    std defaults to 1.6 / sqrt(hidden); the LM head's std is head_scale * 4 / sqrt(hidden) (logits std ~4).
    config_overrides go to the transformers config class (e.g. rope_scaling, tie_word_embeddings)."""
    dest = Path(dest)
    tok_size = write_tokenizer(dest, vocab_size, chat_template=chat_template)
    kw: dict[str, Any] = dict(
        vocab_size=max(vocab_size, tok_size), hidden_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=hidden // n_heads,
        intermediate_size=intermediate, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if family in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = False
    kw.update(config_overrides)
    std = std if std is not None else 1.6 / hidden ** 0.5
    return write_random(dest, family, kw, seed, std, head_scale * 4.0 / hidden ** 0.5 / std)


def write_random(dest: Path, family: str, config: dict[str, Any], seed: int, std: float,
                 head_scale: float) -> Path:
    """Build `family`'s transformers model from the config kwargs, seeded by `seed`, randomize it (randomize)
    and save it as float32 safetensors into `dest`; return `dest`."""
    config_cls, model_cls = model_classes(family)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).to(torch.float32).eval()
    randomize(model, seed, std, head_scale)
    Path(dest).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    return Path(dest)


def write_perturbed(dest: Path, base: Path, perturb: float, seed: int = 0) -> Path:
    """Copy the checkpoint at `base` into `dest` with gaussian noise of std perturb * rms(w) on every weight."""
    from safetensors.torch import load_file, save_file

    dest, base = Path(dest), Path(base)
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
