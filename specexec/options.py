"""Every check and parser of a user-supplied value, and the map from each choice flag to its registry.

Flags, server requests and models.yaml entries arrive as text or loose values; the functions here turn them
into typed values or raise ConfigError with the offending value and what to do instead, so callers never
re-validate. `choices(flag)` gives the names each choice flag accepts: the plain name tables that belong to no
registry live here (--kv-quant, --expert-trim, --gate, --experts: names only, so a configuration checks them
without torch); the others are read from the registry that owns them (offload's quant formats and memory_plan
modes), lazily where that registry imports torch. The frozen configurations these values end up in are
specexec/config.py.

Does not know: the configuration dataclasses, how weights are loaded, or anything about trees; the builder and
verifier names (their registries import the configs: builders.registry and verify check them where they are
used); which devices exist only in check_device, which asks torch lazily.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from offload import memory_plan


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line saying what is wrong and what to do.

    The check_* functions below also say which setting (`subject`, as the caller named it: a field such as
    max_new_tokens, or a flag) and which value was refused, so a command line can name the flag as the user
    typed it (`named`)."""

    subject: str | None = None
    value: Any = None

    def named(self, name: str) -> "ConfigError":
        """The same error with its subject called `name` (e.g. max_new_tokens -> --max-new-tokens)."""
        if not self.subject or self.subject not in str(self):
            return self
        return _about(name, self.value, str(self).replace(self.subject, name, 1))


def about(subject: str, value: Any, message: str) -> ConfigError:
    """A ConfigError about `subject`'s `value` (the setting it names travels with it: `subject`)."""
    error = ConfigError(message)
    error.subject, error.value = subject, value
    return error


_about = about


def choice_error(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> ConfigError:
    """The one way a value outside a list of names is refused: "unknown --quant 'nf5'; choose one of: ..."."""
    return _about(name, value, f"unknown {name} {value!r}; choose one of: {', '.join(map(str, choices))}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, what: str = "size") -> int:
    """'48GB' -> 48e9 bytes, '512MiB' -> 512*2**20, '1.5G' -> 1.5e9, '100B' -> 100. A number without a unit is
    refused ("add a unit: 64GB"): a bare 64 meant as gigabytes would plan with 64 bytes. Raises ConfigError for
    anything else."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size; write it like 48GB, 512MB or 1.5GiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{what}: {text!r} must be larger than zero")
    if m.group(2) is None:
        raise ConfigError(f"{what} {m.group(1)} has no unit; add a unit: {m.group(1)}GB (or MB, GiB, B, ...)")
    return int(value)


def check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    """Raise ConfigError unless value is a finite number in [low, high] (or (low, high] when low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _about(name, value, f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _about(name, value, f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless value is one of choices (named in the message: choice_error)."""
    if value not in choices:
        raise choice_error(name, value, choices)


def _quant_formats() -> tuple[str, ...]:
    from offload import quant                  # the names alone (the package's torch-free __init__)
    return tuple(quant.FORMATS)


# --kv-quant: the formats a KV cache may store its rows in. "int8" is LOSSY and opt-in (specexec/kv/rows.py).
KV_QUANTS = ("none", "int8")

# --expert-trim: which nodes of a grown tree a streamed MoE target verifies (specexec/companions/experts.py).
# experts: the nodes worth the experts they pull in (specexec/tuning/expert_trim.select); nodes: as many
# best-scoring nodes as the same predicted pass time holds (the node-count baseline); off: the tree as grown.
TRIM_MODES = ("experts", "nodes", "off")

# --gate: auto gates with --budget auto only, on always, off never (specexec/companions/gate.py: what gating does).
GATE_MODES = ("auto", "on", "off")

# --experts: where the routed experts of streamed MoE layers compute. stream: copied to the compute device
# (specexec/runtime/expert_stream.py), the default; cpu[:N]: on the CPU where the RAM tier holds them, all
# eligible layers or the last N (specexec/runtime/cpu_experts.py); auto: per layer, whichever the planner
# prices lower (specexec/planning/expert_place.py).
EXPERT_MODES = ("stream", "cpu", "auto")


# --accept: how drafted tokens are judged. exact: every rule keeps the target's output (the default); relaxed: LOSSY,
# LANTERN's latent-proximity rule within a total-variation budget delta over the k nearest tokens by input-embedding
# cosine (specexec/acceptance/relaxed.py; its text: acceptance/parsing.py). Defaults of relaxed's two parameters:
ACCEPT_MODES = ("exact", "relaxed")
RELAXED_DELTA = 0.1
RELAXED_K = 10


def check_accept(mode: str, delta: Any, k: Any) -> None:
    """ConfigError unless (mode, delta, k) is an --accept value: delta in [0, 1], k >= 1."""
    check_choice("--accept", mode, ACCEPT_MODES)
    check_number("--accept delta", delta, low=0.0, high=1.0)
    check_integer("--accept k", k, low=1, high=10**7)


def parse_experts(text: str) -> tuple[str, int | None]:
    """'stream' | 'cpu' | 'cpu:N' | 'auto' -> (mode, N or None: every eligible layer). ValueError (one line
    naming the value and what to write) for anything else."""
    raw = str(text).strip().lower()
    mode, sep, count = raw.partition(":")
    if mode not in EXPERT_MODES or (sep and mode != "cpu"):
        raise ValueError(f"unknown --experts {text!r}; choose one of: stream, cpu, cpu:N (N sparse layers), auto")
    if not sep:
        return mode, None
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--experts {text!r}: N in cpu:N must be a whole number of sparse layers >= 1, e.g. cpu:8")
    return mode, int(count)


def check_experts(value: Any) -> None:
    """Raise ConfigError unless value is an --experts value (parse_experts)."""
    try:
        parse_experts(value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# Choice flag -> where its accepted values are registered. Flags, --help text, validation and error messages
# all call choices(); no other module lists these names. --builder and --verifier are not here: their
# registries (specexec.builders.registry.names(), specexec.acceptance.rules.verifier_names()) import the configs, so
# their names are checked where those registries are used (make_builder, the Engine, Runtime.load), never by
# a config under construction (which would import torch and every builder, and close an import cycle).
_CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {
    "--dtype": lambda: DTYPES,
    "--kv-quant": lambda: KV_QUANTS,
    "--quant": lambda: ("auto", *_quant_formats()),    # offload.quant.FORMATS, plus auto
    "--draft-quant": _quant_formats,
    "--offload": lambda: memory_plan.OFFLOAD_MODES,
    "--kv-offload": lambda: memory_plan.COMPANION_MODES,   # where streamed layers' KV rows live
    "--expert-trim": lambda: TRIM_MODES,
    "--gate": lambda: GATE_MODES,
    "--accept": lambda: ACCEPT_MODES,
}


def choices(flag: str) -> tuple[str, ...]:
    """The accepted values of a choice flag ("--builder", "--quant", ...), read from the registry that owns
    them; KeyError for a flag that has no registry."""
    return _CHOICES[flag]()


def choices_help(flag: str) -> str:
    """choices(flag) as --help text writes them: 'a | b | c'."""
    return help_list(choices(flag))


def help_list(names: tuple[str, ...]) -> str:
    """Accepted names as --help text writes them: 'a | b | c' (also for registries outside choices())."""
    return " | ".join(names)


def check_name(name: str, value: Any) -> None:
    """Raise ConfigError unless value is a non-empty string (a registry checks later that it names something)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name} must be a name, got {value!r}")


def check_integer(name: str, value: Any, low: int, high: int) -> None:
    """Raise ConfigError unless value is an integer (not a bool, not 2.5) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _about(name, value, f"{name} must be an integer, got {value!r}")
    check_number(name, value, low=low, high=high)


DTYPES = ("auto", "float32", "bfloat16", "float16")     # the run dtype; loading.DTYPES maps these to torch
MAX_BUDGET = 16384
AUTO_MAX_BUDGET = 1024              # the largest tree --budget auto tries unless --max-budget says otherwise


def budget_options(value: str | int | None, max_budget: int | None = None) -> dict[str, Any]:
    """--budget N|auto -> EngineConfig keywords ({} when not given). 'auto' searches up to max_budget."""
    if value is None:
        return {}
    if str(value).strip().lower() == "auto":
        top = AUTO_MAX_BUDGET if max_budget is None else max_budget
        check_number("--max-budget", top, low=1, high=MAX_BUDGET)
        return {"budget": top, "auto_budget": True}
    try:
        return {"budget": int(str(value).strip())}
    except ValueError:
        raise ConfigError(f"--budget {value!r} is not a number of tree tokens or 'auto'") from None


SELF_DRAFT = "self"           # --draft self[:FORMAT]: the target drafts with its own layers (runtime/self_draft.py)


def is_self_draft(spec: str | None) -> bool:
    """Whether a --draft value (or a models.yaml drafts item) names the self-draft: "self" or "self:FORMAT"."""
    return spec is not None and (spec.strip() == SELF_DRAFT or spec.strip().startswith(SELF_DRAFT + ":"))


def parse_draft_layers(text: str | int) -> int | str:
    """--draft-layers N|auto -> N or "auto"."""
    return _count_or_auto("--draft-layers", text, "decoder layers")


def parse_draft_vocab(text: str | None) -> int | str | None:
    """--draft-vocab N|auto -> N, "auto" or None (not given)."""
    return None if text is None else _count_or_auto("--draft-vocab", text, "tokens")


def _count_or_auto(flag: str, text: str | int, what: str) -> int | str:
    """A flag's N|auto value -> N or "auto"; ConfigError naming the flag and what N counts otherwise."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a number of {what} or 'auto'") from None


def check_draft_vocab(value: int | str | None, vocab_size: int | None = None) -> None:
    """None, "auto", or a token count in [1, vocab_size] (the draft's vocabulary, once it is known)."""
    if value is None or value == "auto":
        return
    if isinstance(value, str):
        raise ConfigError(f"--draft-vocab {value!r} is not a number of tokens or 'auto'")
    check_number("--draft-vocab", value, low=1, high=vocab_size or 10**7)


def check_device(device: str) -> None:
    """Raise ConfigError when `device` names CUDA but torch sees no CUDA device (or not that many)."""
    if not device.startswith("cuda"):
        return
    import torch                                     # only here: the rest of this module is torch-free

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device} but torch sees no CUDA device; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device} but torch sees only {torch.cuda.device_count()} CUDA device(s)")


def check_budget_fits(flag: str, value: int | None, total: int, what: str) -> None:
    """A --ram-budget/--gpu-budget beyond what the machine has (`total` bytes of `what`) is a typo, not a plan:
    planning with it would run out of memory halfway. Raise ConfigError naming both sizes (None: not given)."""
    if value is not None and value > total:
        raise ConfigError(f"{flag} {value / 1e9:.2f} GB is more than this machine's {total / 1e9:.2f} GB of {what}; "
                          f"pass at most that, or leave {flag} out to use what is free")


def check_draft_choice(draft: str | None, no_draft: bool, builder: str, builder_needs_draft: bool) -> None:
    """--draft PATH and --no-draft exclude each other; a builder that needs a draft needs one of them."""
    if draft and no_draft:
        raise ConfigError("--draft and --no-draft exclude each other; pass one of them")
    if not draft and not no_draft and builder_needs_draft:
        raise ConfigError(f"the {builder!r} builder needs a draft model: pass --draft PATH, "
                          "or --no-draft to decode with the target alone")


def check_prompt_length(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Raise ConfigError unless the prompt is not empty and, plus max_new_tokens, fits the model's context."""
    if prompt_tokens == 0:
        raise ConfigError("the prompt is empty (0 tokens); pass some text")
    if prompt_tokens + max_new_tokens > context:
        raise ConfigError(f"the prompt has {prompt_tokens} tokens; with max_new_tokens {max_new_tokens} that "
                          f"exceeds the model's context of {context} tokens (at most "
                          f"{max(context - max_new_tokens, 0)} prompt tokens); shorten the prompt or lower "
                          "--max-new-tokens")


def check_prompt_text(text: str, what: str = "the prompt", allow_empty: bool = False) -> None:
    """Raise ConfigError for prompt text that is empty or whitespace only (unless allow_empty; generating from
    BOS alone is never what was meant) or not valid Unicode (lone surrogates: how Python hands over argv bytes
    that are not UTF-8). Control characters are fine: they are text the model sees."""
    if not allow_empty and not text.strip():
        raise ConfigError(f"{what} is empty; pass some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid UTF-8 (undecodable byte at character {e.start}); "
                          "pass UTF-8 text") from None


def check_chat_options(chat: bool, system: str | None) -> None:
    """A system message only exists inside a chat template."""
    if system is not None and not chat:
        raise ConfigError("--system applies only with --chat; add --chat or drop --system")


def parse_budget_list(text: str, auto_supported: bool) -> tuple[int | str, ...]:
    """'16,64,256' -> (16, 64, 256); 'auto' is kept as 'auto' when this build can pick budgets itself."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--budgets {text!r} lists no budget; write them like 16,64,256")
    out: list[int | str] = []
    for item in items:
        if item.lower() == "auto":
            if not auto_supported:
                raise ConfigError("--budgets: 'auto' needs the budget tuner, which this build does not have; "
                                  "list integer budgets such as 16,64,256")
            out.append("auto")
            continue
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--budgets: {item!r} is not an integer or 'auto'; write them like 16,64,256") from None
        check_number("budget", value, low=1, high=MAX_BUDGET)
        out.append(value)
    return tuple(dict.fromkeys(out))


def parse_float_list(flag: str, text: str) -> tuple[float, ...]:
    """'0,0.6' -> (0.0, 0.6) for a list-valued flag such as --temperatures (each value is checked by whoever
    uses it, e.g. SamplingParams)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag} {text!r} lists no value; write them like 0,0.6")
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: every item must be a number, like 0,0.6") from None
    return tuple(dict.fromkeys(values))
