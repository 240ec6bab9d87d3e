"""Benchmark prompt sets: the built-in one (builtin.jsonl: 40 prompts, ten each of chat, code, reasoning and
summarisation) and a user's own JSONL file in the same format, one object per line:

    {"id": "code-01", "category": "code", "prompt": "Write a Python function ...", "system": "optional"}

Only `prompt` is required; any key outside id, category, prompt and system is an error (one line naming the
file, the line and the key). Blank lines are skipped.

Does not know: tokenizers, chat templates or context lengths (the bench encodes and truncates).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specexec.options import ConfigError

BUILTIN = "builtin.jsonl"
KEYS = ("id", "category", "prompt", "system")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    system: str | None = None


def parse_prompts(text: str, source: str) -> list[Prompt]:
    """Prompts from JSONL text; ConfigError naming `source` and the line for each problem."""
    out: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{source}:{n} is not a JSON object ({e})") from None
        out.append(_prompt(obj, f"{source}:{n}", len(out) + 1))
    if not out:
        raise ConfigError(f"{source} holds no prompts; write one JSON object per line with a \"prompt\" key")
    return out


def _prompt(obj: object, where: str, index: int) -> Prompt:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} must be a JSON object with a \"prompt\" key")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(KEYS)}")
    text = obj.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: \"prompt\" must be a non-empty string")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{where}: \"system\" must be a string")
    return Prompt(str(obj.get("id", f"prompt-{index:02d}")), str(obj.get("category", "user")), text, system)


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The prompts in the JSONL file `path`, or the built-in set when path is None."""
    if path is None:
        return parse_prompts(resources.files(__name__).joinpath(BUILTIN).read_text(encoding="utf-8"), BUILTIN)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--prompts {path} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"cannot read --prompts {path}: {e.strerror or e}") from None
    return parse_prompts(text, str(path))
