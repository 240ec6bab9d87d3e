"""Tokenizers: transformers' AutoTokenizer from the checkpoint directory, the model's own chat template, and
the draft/target compatibility check (same token -> id mapping; embedding tables may be padded differently).

A .gguf file carries its tokenizer (vocabulary, merges, special ids, chat template) as metadata. transformers
builds it (AutoTokenizer.from_pretrained(dir, gguf_file=name)), which takes ~30 s for a 150k vocabulary, so
the result is saved once under <cache root>/gguf-tokenizers/ (key: the file's path, size, mtime and the
transformers version) and later runs load that directory. Tokens transformers adds beyond the file's vocabulary
(its GPT-2 class adds <|endoftext|> when the vocabulary lacks it) are dropped: the ids must stay the file's.

Does not know: models, trees, generation.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from offload.formats.sources import is_gguf

from specexec.options import ConfigError

GGUF_TOKENIZER_CACHE_VERSION = 1


def load_tokenizer(path: Path):
    """AutoTokenizer from a local directory (or a .gguf file's metadata), offline (local_files_only: nothing
    process-wide is switched, so a later Hub name in the same process still downloads); one clear error when
    it is missing or unreadable."""
    if is_gguf(path):
        return _gguf_tokenizer(Path(path))
    from transformers import AutoTokenizer
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((path / f).is_file() for f in names):
        raise ConfigError(f"{path} has no tokenizer files (tokenizer.json or tokenizer.model); "
                          "copy them from the original model")
    config = _named_class_config(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **({"config": config} if config else {}))
    except Exception as e:
        raise ConfigError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None


def _named_class_config(path: Path):
    """What AutoTokenizer reads of the model's config when tokenizer_config.json names the tokenizer class and
    brings no code of its own: the model type and the path, in a plain PretrainedConfig. Left to AutoTokenizer,
    AutoConfig imports the model's config class and with it transformers' model-loading machinery (about 2 s of
    every start). None (AutoTokenizer loads the config itself) in every other case."""
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(declared, dict) or not declared.get("tokenizer_class") or "auto_map" in declared \
            or not isinstance(model_type, str) or not model_type:
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type, config._name_or_path = model_type, str(path)
    return config


def _gguf_tokenizer(path: Path):
    """The tokenizer in a GGUF file's metadata, built once and then loaded from its cache directory."""
    cached = _gguf_tokenizer_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return load_tokenizer(cached)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    except OSError:                                     # no writable cache: build into a throwaway directory
        with tempfile.TemporaryDirectory() as tmp_dir:
            _build_gguf_tokenizer(path, Path(tmp_dir))
            return load_tokenizer(Path(tmp_dir))
    try:
        _build_gguf_tokenizer(path, tmp)
        try:
            os.replace(tmp, cached)
        except OSError:
            if not (cached / "tokenizer_config.json").is_file():   # not a concurrent builder's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(cached)


def _gguf_tokenizer_dir(path: Path) -> Path:
    import transformers
    from offload.cache.identity import default_cache_root

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{GGUF_TOKENIZER_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{path.parent.name}-{path.stem}")
    return default_cache_root() / "gguf-tokenizers" / f"{name}-{digest}"


def _build_gguf_tokenizer(path: Path, dest: Path) -> None:
    """transformers' tokenizer from the GGUF metadata, saved to dest with only the file's own token ids."""
    from transformers import AutoTokenizer

    from offload.formats.gguf import open_gguf

    meta = open_gguf(path).meta
    if "tokenizer.ggml.tokens" not in meta:
        raise ConfigError(f"{path} carries no tokenizer in its metadata (no tokenizer.ggml.tokens)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        kind = meta.get("tokenizer.ggml.model")
        raise ConfigError(f"cannot build the tokenizer from the GGUF metadata of {path} (tokenizer.ggml.model "
                          f"{kind!r}): {str(e).splitlines()[0]}") from None
    tok.save_pretrained(str(dest))
    _drop_tokens_beyond(dest, len(meta["tokenizer.ggml.tokens"]))


def _drop_tokens_beyond(directory: Path, n_tokens: int) -> None:
    """Remove added tokens with ids >= n_tokens from a saved fast tokenizer (tokenizer.json + config)."""
    tj_file, cfg_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
    tj = json.loads(tj_file.read_text())
    extra = {t["content"] for t in tj.get("added_tokens", []) if t["id"] >= n_tokens}
    if not extra:
        return
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < n_tokens]
    tj_file.write_text(json.dumps(tj, ensure_ascii=False))
    cfg = json.loads(cfg_file.read_text())
    decoder = cfg.get("added_tokens_decoder") or {}
    cfg["added_tokens_decoder"] = {k: v for k, v in decoder.items() if int(k) < n_tokens}
    for key in ("additional_special_tokens", "extra_special_tokens"):
        if isinstance(cfg.get(key), list):
            cfg[key] = [t for t in cfg[key] if (t if isinstance(t, str) else t.get("content")) not in extra]
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if cfg.get(key) in extra:
            cfg[key] = None
    cfg_file.write_text(json.dumps(cfg, ensure_ascii=False, indent=2))


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
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a whole conversation ([{"role", "content"}, ...]) through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; chat needs an instruct/chat checkpoint")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):       # transformers >= 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_ids(tokenizer, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """Every id that ends generation: config.json's eos ids plus the tokenizer's eos token."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
