"""Tokenizers: transformers' AutoTokenizer from the checkpoint directory, the model's own chat template, and
the draft/target compatibility check before any weight loads (`check_compatible`: the same token -> id map,
BOS/EOS and chat turn end; a draft vocabulary that is a prefix of the target's, or embedding tables padded to
other sizes, go with a note; anything else is one line naming the first token that differs).

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
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                  **({"config": config} if config else {}))
    except Exception as e:
        raise ConfigError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None
    return _quiet(tokenizer)


LONG_TEXT_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def _quiet(tokenizer):
    """The tokenizer without transformers' "Token indices sequence length is longer than the specified maximum"
    (its model_max_length is often not the model's context): the context is checked here, in one line."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned[LONG_TEXT_WARNING] = True
    return tokenizer


def _named_class_config(path: Path):
    """What AutoTokenizer reads of the model's config when tokenizer_config.json names the tokenizer class and
    brings no code of its own: the model type and the path, in a plain PretrainedConfig. Left to AutoTokenizer,
    AutoConfig imports the model's config class and with it transformers' model-loading machinery (about 2 s of
    every start). None (AutoTokenizer loads the config itself) in every other case."""
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
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
    from cpu_kernels.cache_root import default_cache_root

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
        kind, first = meta.get("tokenizer.ggml.model"), (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = ("; the file's weights load (specexec plan reads it), but text needs its tokenizer: run this model "
                "from its Hugging Face checkpoint (safetensors and tokenizer files)" if "not supported" in first
                else "")
        raise ConfigError(f"cannot build the tokenizer from the GGUF metadata of {path} (tokenizer.ggml.model "
                          f"{kind!r}): {first}{hint}") from None
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


def check_compatible(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> str | None:
    """Whether a draft can draft for a target, from their tokenizers alone (before any weight is loaded): the
    same token -> id map, the same BOS/EOS tokens and the same chat turn end -> None (nothing to say); the
    draft's vocabulary a prefix of the target's, or the two embedding tables padded to different sizes -> the
    line that says so (the draft's logits are then aligned to the target's rows: draft_vocab.align_vocab);
    anything else -> ConfigError naming the first token that differs. Every token id must fit both tables."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    differs = _first_difference(tv, dv)
    if differs is not None:
        raise ConfigError(f"draft and target tokenizers disagree: {differs}; pick a draft with the target's "
                          "tokenizer (the same model family)")
    for role, t, d in _special_roles(target_tok, draft_tok):
        if t != d:
            raise ConfigError(f"draft and target tokenizers disagree on the {role}: target {t!r}, draft {d!r}; "
                              "pick a draft with the target's tokenizer (e.g. an instruct draft for an instruct "
                              "target)")
    for who, vocab, rows in (("target", tv, target_vocab), ("draft", dv, draft_vocab)):
        top = max(vocab.values())
        if top >= rows:
            raise ConfigError(f"the {who}'s tokenizer has ids up to {top}, which need {top + 1} embedding rows, but "
                              f"its model's vocabulary has {rows} rows; pair the model with "
                              f"its own tokenizer")
    notes = []
    if len(dv) < len(tv):
        notes.append(f"the draft's vocabulary is the first {len(dv)} of the target's {len(tv)} tokens (the target's "
                     f"last {len(tv) - len(dv)} are never drafted)")
    if draft_vocab - len(dv) != target_vocab - len(tv):              # rows beyond the tokens: padding
        notes.append(f"the embedding tables are padded differently (draft {draft_vocab} rows, target {target_vocab}):"
                     f" the draft proposes from the first {min(draft_vocab, target_vocab)}")
    return "compatible tokenizers: " + "; ".join(notes) if notes else None


def _first_difference(tv: dict[str, int], dv: dict[str, int]) -> str | None:
    """The lowest id whose token differs between the two vocabularies (a draft that lacks only the target's
    last ids is a prefix, not a difference), in words; None when none differs."""
    t_at, d_at = {i: t for t, i in tv.items()}, {i: t for t, i in dv.items()}
    for i in sorted(set(t_at) | set(d_at)):
        t, d = t_at.get(i), d_at.get(i)
        if t == d or (d is None and i > max(d_at, default=-1)):
            continue
        return (f"id {i} is {t!r} in the target, {d!r} in the draft" if t is not None and d is not None else
                f"id {i} is {d!r} in the draft and absent from the target" if t is None else
                f"id {i} is {t!r} in the target and absent from the draft")
    return None


def _special_roles(target_tok, draft_tok) -> list[tuple[str, object, object]]:
    """(role, target's, draft's) for the BOS and EOS tokens and the chat template's end of a turn."""
    roles = [(f"{name} token", getattr(target_tok, f"{name}_token", None), getattr(draft_tok, f"{name}_token", None))
             for name in ("bos", "eos")]
    return roles + [("chat template's end of a turn", turn_end(target_tok), turn_end(draft_tok))]


def turn_end(tokenizer) -> str | None:
    """The token the chat template closes an assistant turn with (None without a template, or when the template
    adds nothing after the message): the first token of what follows a marker message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "zq7 marker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:                                    # noqa: BLE001 -- a template that refuses this shape
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids else None


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of `text`: the tokenizer's default encoding, or wrapped by the chat template when chat=True."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of a whole conversation ([{"role", "content"}, ...]) through the model's chat template, with
    `tools` (OpenAI function tools) when given."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; chat needs an instruct/chat checkpoint")
    extra = {"tools": tools} if tools else {}
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError,
            RecursionError) as e:
        # the checkpoint's template is code: whatever it raises (jinja's sandbox refusing an attribute, its own
        # raise_exception, a bad type) is said in one line, as the checkpoint's
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"the model's chat template failed ({type(e).__name__}: {reason})") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):       # transformers >= 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def eos_ids(tokenizer, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """Every id that ends generation: config.json's eos ids plus the tokenizer's eos token."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
