"""Tokenizers: transformers' AutoTokenizer from the checkpoint directory, the model's own chat template, and
the draft/target compatibility check (same token -> id mapping; embedding tables may be padded differently).

Does not know: models, trees, generation.
"""
from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError


def load_tokenizer(path: Path):
    """AutoTokenizer from a local directory, offline; one clear error when it is missing or unreadable."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise ConfigError(f"{path} has no tokenizer files (tokenizer.json or tokenizer.model); "
                          "copy them from the original model")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ConfigError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None


def check_compatible(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """Raise ConfigError unless both tokenizers map every token to the same id and fit both models."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = next((t for t in tv if dv.get(t) != tv[t]), None) or next(t for t in dv if t not in tv)
        raise ConfigError(f"draft and target tokenizers disagree (e.g. token {diff!r}: target id {tv.get(diff)}, "
                          f"draft id {dv.get(diff)}); pick a draft from the same model family")
    if max(tv.values()) >= min(target_vocab, draft_vocab):
        raise ConfigError(f"the tokenizer has ids up to {max(tv.values())} but a model's vocabulary has only "
                          f"{min(target_vocab, draft_vocab)} rows")


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of `text`: the tokenizer's default encoding, or wrapped by the chat template when chat=True."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):       # transformers >= 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_ids(tokenizer, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """Every id that ends generation: config.json's eos ids plus the tokenizer's eos token."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
