"""The one table of supported architectures: HF architecture name -> (family name, the module that reads its
config.json), and the one precise line for every architecture outside it.

A family module exposes ARCHITECTURES ({HF architecture: family name}) and `model_args(family, cfg) ->
ModelArgs` (HYBRID = True where its configs name layer kinds beyond attention that it runs), and where its
checkpoints name tensors otherwise, what specexec/checkpoints/weight_map.py reads (WEIGHT_RULES, STORED_PREFIXES,
UNUSED), and SUMMARY: one line of what its maths adds to Llama's. Adding a
family is adding its module to FAMILY_MODULES; nothing else lists architectures: `specexec --help`, `specexec
models` and the README's table of supported models are made from `summaries()`.

Does not know: the network, checkpoints' tensors (specexec/checkpoints/loading.py), devices.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from specexec.config import ModelArgs
from specexec.families import (deepseek, gemma, gemma4, glm4_moe, gpt_oss, llama, minimax_m2, mixtral, olmoe,
                               phi3, qwen_hybrid, qwen_moe)
from specexec.families.common import recurrent_reason, sparse_attention_reason
from specexec.families.config_values import check_config_values
from specexec.options import ConfigError

FAMILY_MODULES: tuple[ModuleType, ...] = (llama, gemma, phi3, qwen_moe, mixtral, olmoe, gpt_oss, glm4_moe,
                                          minimax_m2, qwen_hybrid, deepseek, gemma4)


@functools.cache
def architectures() -> dict[str, tuple[str, ModuleType]]:
    """HF architecture name -> (family name, its module), in FAMILY_MODULES order."""
    table: dict[str, tuple[str, ModuleType]] = {}
    for module in FAMILY_MODULES:
        for arch, family in module.ARCHITECTURES.items():
            if arch in table:
                raise RuntimeError(f"architecture {arch} is claimed by two family modules")
            table[arch] = (family, module)
    return table


@functools.cache
def family_module(family: str) -> ModuleType:
    """The module of a family name (ModelArgs.family); KeyError for a name no module claims."""
    for name, module in architectures().values():
        if name == family:
            return module
    raise KeyError(family)


def family_names() -> tuple[str, ...]:
    """Every family name a supported architecture maps to, sorted (models.yaml's `family` values)."""
    return tuple(sorted({family for family, _ in architectures().values()}))


def model_args(cfg: dict[str, Any], where: str = "config.json", names: dict[str, str] | None = None) -> ModelArgs:
    """ModelArgs from a parsed config.json; ConfigError (one line) for an architecture outside the table or a
    config lacking a field its family needs. `where` and `names`: how a line names the file and a key when `cfg`
    was built from another format (a GGUF file's metadata: check_config_values)."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{where}: architectures must be a list of names, got {archs!r}")
    found = next((architectures()[a] for a in archs if a in architectures()), None)
    if found is None:
        raise ConfigError(refusal(cfg))
    family, module = found
    if recurrent_reason(cfg) is not None and not getattr(module, "HYBRID", False):
        raise ConfigError(refusal(cfg))                 # a supported name with recurrent layers it cannot run
    check_config_values(cfg, where, names)            # every size and float before a family reads one
    try:
        return module.model_args(family, cfg)
    except ConfigError:
        raise
    except KeyError as e:
        key = (names or {}).get(e.args[0], repr(e.args[0]))
        raise ConfigError(f"{where} lacks the field {key} needed for a {family} model") from None
    except (TypeError, ValueError, AttributeError) as e:          # a field of a type the family cannot read
        raise ConfigError(f"{where} holds a value a {family} model cannot read ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None


def refusal(cfg: dict[str, Any]) -> str:
    """The line for a config whose architecture specexec does not run: which one, that it is not supported
    (for a hybrid / recurrent model also why: common.recurrent_reason), and what is."""
    why = recurrent_reason(cfg) or sparse_attention_reason(cfg)
    if why is not None:
        return f"{why}; supported: {', '.join(architectures())}"
    archs = cfg.get("architectures") or []
    shown = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
    return f"unsupported architecture {shown}; supported: {', '.join(architectures())}"


def supported() -> list[tuple[str, list[str]]]:
    """(family, its HF architectures) of every supported architecture, in registry order (`specexec models`)."""
    out: dict[str, list[str]] = {}
    for arch, (family, _) in architectures().items():
        out.setdefault(family, []).append(arch)
    return list(out.items())


def summaries() -> list[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(family names, HF architectures, what differs from Llama) per family module, in registry order: the
    module's SUMMARY, else the first sentence of its docstring."""
    out = []
    for module in FAMILY_MODULES:
        families = tuple(dict.fromkeys(module.ARCHITECTURES.values()))
        text = getattr(module, "SUMMARY", None) or " ".join((module.__doc__ or "").split()).split(". ")[0]
        out.append((families, tuple(module.ARCHITECTURES), text.rstrip(".")))
    return out
