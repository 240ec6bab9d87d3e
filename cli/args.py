"""Command-line flags that several subcommands share (generate, chat, bench, serve; `plan` takes the ones it
plans with), defined once (`add_flag`: the text, the default said, the argparse keywords), and turning them
into the frozen configs of specexec.config.

Groups: model (--model --draft PATH|NAME|self[:FMT] / --no-draft --allow-pickle --offline --gguf-file), engine
(--budget N|auto --max-budget --builder --device --dtype --kv-quant --expert-trim --gate --accept --max-new-tokens),
sampling (--temperature --top-p --top-k --seed and the other SamplingParams fields), offload (--quant --draft-quant --offload --gpu-budget
--ram-budget --cache-dir --context --kv-offload --draft-layers --experts). `apply_catalog_defaults` fills what a
models.yaml name implies (the recommended draft, budget and quantization) when the user left it out, and says so;
`check_draft(..., default_self=True)` (chat) drafts with the target itself when no draft is named or recommended.
`load_runtime` is the one place these commands load models (the memory ledger first, then a progress spinner on stderr).

Does not know: what a value may be (specexec.options checks every one of them), how models load.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from rich.console import Console

from specexec.acceptance.parsing import parse as parse_accept
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from cli.fetch import add_hub_args, fetch_model
from cli.help import LazyHelp
from specexec.options import (ConfigError, budget_options, check_draft_choice, choices_help, help_list, is_self_draft,
                              parse_size)
from specexec.builders.registry import builder_needs_draft, names as builder_names

if TYPE_CHECKING:                                  # only annotations: parsing never imports torch (cli/main.py)
    from specexec.checkpoints.hub import Reserve
    from specexec.planning.target import TargetPlan
    from specexec.runtime.assembly import Runtime

# SamplingParams fields that get a flag here: name -> (type, metavar, help)
SAMPLING_FLAGS = {
    "temperature": (float, "T", "0 = greedy (default)"),
    "top_p": (float, "P", "nucleus sampling mass (default 1)"),
    "top_k": (int, "K", "sample among the K best (0 = all)"),
    "min_p": (float, "P", "drop tokens below P x the best token's probability (default 0)"),
    "repetition_penalty": (float, "R", "penalise tokens already in the context, per tree node (1 = off)"),
    "presence_penalty": (float, "P", "OpenAI's: subtract P from every token this answer already generated, "
                         "per tree node (-2..2, default 0)"),
    "frequency_penalty": (float, "F", "OpenAI's: subtract F x the times this answer already generated a token, "
                          "per tree node (-2..2, default 0)"),
    "seed": (int, "S", "random seed for sampling (generate --n: sample i uses S + i)"),
}


@dataclass(frozen=True)
class Flag:
    """One shared flag: argparse keywords, its --help text and what its default is (as --help says it; a
    command may say another default, e.g. `specexec plan`, which applies no models.yaml defaults)."""

    text: str | Callable[[], str]         # a callable: read when a help shows it (cli/help.py LazyHelp)
    default: str = ""
    kwargs: dict = field(default_factory=dict)


def _flags() -> dict[str, Flag]:
    """Every shared flag, built when a parser is (the registries' names as they are then)."""
    return {
        "--model": Flag("target checkpoint directory, a name from `specexec models`, or a Hub id ORG/NAME "
                        "(downloaded once into the Hugging Face cache: config, tokenizer, safetensors)",
                        kwargs={"metavar": "PATH|NAME"}),
        "--draft": Flag("draft checkpoint (same tokenizer as the target), or self: the target's own layers "
                        "(resident low-bit copies of the ones it streams, FMT default int4 on a CPU, nf4 on CUDA; "
                        "see --draft-layers), or eagle3:PATH|ORG/NAME: an EAGLE-3 head trained for this target, "
                        "or mtp: the MTP layer in the target's own checkpoint (both draft from the target's hidden "
                        "states)", "for a models.yaml target: its recommended draft",
                        {"metavar": "PATH|NAME|self[:FMT]|eagle3:PATH|mtp"}),
        "--max-new-tokens": Flag("at most N new tokens", "128", {"type": int, "metavar": "N"}),
        "--budget": Flag("draft tree size in tokens, or auto: picked per step from measured pass costs and "
                         "acceptance; a number N fixes it", "auto, or the models.yaml entry's", {"metavar": "N|auto"}),
        "--max-budget": Flag("largest tree --budget auto tries", "1024", {"type": int, "metavar": "N"}),
        "--builder": Flag(lambda: f"tree builder: {help_list(builder_names())}", "specexec", {"metavar": "NAME"}),
        "--device": Flag("cpu or cuda", "cuda where torch sees a GPU, else cpu", {"metavar": "DEV"}),
        "--dtype": Flag(choices_help("--dtype"), "auto: bf16 on CUDA, fp32 on CPU", {"metavar": "TYPE"}),
        "--kv-quant": Flag(f"KV cache rows: {choices_help('--kv-quant')}", "none; int8 is LOSSY: half the memory "
                           "and bytes moved; the output may differ from the target's, so no exactness claim holds",
                           {"metavar": "FMT"}),
        "--quant": Flag(lambda: f"target layer format: {choices_help('--quant')}", "auto, or the models.yaml entry's",
                        {"metavar": "FMT"}),
        "--draft-quant": Flag(lambda: f"draft linear layers: {choices_help('--draft-quant')}",
                              "none; the draft always stays resident", {"metavar": "FMT"}),
        "--offload": Flag(f"where target layers live: {choices_help('--offload')}", "auto: the planner decides "
                          "from the budgets; none = all resident, ram = all streamed from (pinned) RAM, ssd = all "
                          "streamed from the on-disk layer cache", {"metavar": "TIER"}),
        "--gpu-budget": Flag("GPU memory to use, e.g. 22GB", "free minus a margin", {"metavar": "SIZE"}),
        "--ram-budget": Flag("RAM to use, e.g. 48GB", "free minus a margin", {"metavar": "SIZE"}),
        "--cache-dir": Flag("root of the quantized layer cache", "$SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, "
                            "else ~/.cache/specexec", {"metavar": "DIR"}),
        "--context": Flag("tokens (prompt + answer) the memory plan reserves KV cache for", "4096, at most the "
                          "model's maximum; longer chats grow past the plan", {"type": int, "metavar": "N"}),
        "--kv-offload": Flag(f"target KV rows: {choices_help('--kv-offload')}", "auto: on the device, or in RAM "
                             "travelling with their layer when the device runs short", {"metavar": "WHERE"}),
        "--expert-trim": Flag(f"MoE targets whose experts stream: {choices_help('--expert-trim')}", "experts: "
                              "verify the grown tree's nodes worth the experts they pull in (lossless); nodes: as "
                              "many best-scoring nodes as the same predicted pass time holds; off: the whole tree",
                              {"metavar": "MODE"}),
        "--gate": Flag(f"stop drafting while the target alone is measured faster, probing now and then to "
                       f"resume: {choices_help('--gate')}", "auto: on with --budget auto, off with a fixed "
                       "--budget N", {"metavar": "MODE"}),
        "--accept": Flag("how drafted tokens are judged: exact, or relaxed[:delta=D,k=K]: LOSSY, a drafted token also "
                         "passes when the target's mass on its K nearest tokens (input-embedding cosine) lifts it, "
                         "keeping the total variation from the target's distribution at each node <= D; labelled in "
                         "every output", "exact; relaxed's delta 0.1, k 10", {"metavar": "MODE"}),
        "--experts": Flag("MoE targets: where the routed experts of streamed sparse layers compute: stream (copied "
                          "to the device as routed), cpu (in RAM on the CPU, only hidden states cross the link), "
                          "cpu:N (the last N such layers), auto (per layer, whichever the planner prices lower)",
                          "stream", {"metavar": "stream|cpu[:N]|auto"}),
        "--prompt-cache": Flag("keep the KV rows of prompts (in blocks) for any later prompt that begins with "
                               "them: in RAM and on disk under the cache root, so a restarted server or a new "
                               "chat finds them; SIZE bounds the disk tier (least recently used out first), e.g. "
                               "8GB", "0: off (the previous answer's prefix is still reused)",
                               {"metavar": "SIZE"}),
        "--draft-layers": Flag("with --draft self: how many of the target's decoder layers the draft runs, evenly "
                               "spaced, first and last included", "auto: measured at load, the fastest of "
                               "the most whose copies fit (half of a wholly resident target) and 3/4 to 1/4 of "
                               "them", {"metavar": "N|auto"}),
    }


def add_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, says: str | None = None,
             text: str | None = None, **kwargs) -> None:
    """Add the shared `flag` to p, its --help saying the default is `says` (else the flag's own; "": no
    default said) after `text` (else the flag's own); kwargs: argparse keywords this command adds or changes
    (required, type, a default value, ...)."""
    f = _flags()[flag]
    said = f.default if says is None else says
    base, suffix = (f.text if text is None else text), (f" (default {said})" if said else "")
    # a text that reads a registry importing torch (the builders') is read when a help shows it
    helptext = LazyHelp(lambda: base() + suffix) if callable(base) else base + suffix
    p.add_argument(flag, **{**f.kwargs, **kwargs, "help": helptext})


def heading(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """p's option group `title` (--help-all's heading), made on first use."""
    found = next((g for g in p._action_groups if g.title == title), None)
    return found if found is not None else p.add_argument_group(title)


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = heading(p, "model")
    add_flag(g, "--model", required=required)
    draft = g.add_mutually_exclusive_group()
    add_flag(draft, "--draft")
    draft.add_argument("--no-draft", action="store_true", help="decode with the target alone (the baseline)")
    g.add_argument("--allow-pickle", action="store_true",
                   help="read pickle (.bin) weights with torch.load(weights_only=True)")
    g.add_argument("--allow-outside-shards", action="store_true",
                   help="read weight files that an index or a symlink places outside the checkpoint directory")
    add_hub_args(g)


def add_engine_args(p: argparse.ArgumentParser, max_new_default: str = "128") -> None:
    g = heading(p, "engine")
    add_flag(g, "--max-new-tokens", max_new_default)
    for flag in ("--budget", "--max-budget", "--builder", "--device", "--dtype", "--kv-quant", "--expert-trim",
                 "--gate", "--accept"):
        add_flag(g, flag)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = heading(p, "sampling")
    known = {f.name for f in fields(SamplingParams)}
    for name, (kind, metavar, text) in SAMPLING_FLAGS.items():
        if name in known:
            g.add_argument("--" + name.replace("_", "-"), type=kind, metavar=metavar, help=text)


def add_offload_args(p: argparse.ArgumentParser, context_list: bool = False) -> None:
    g = heading(p, "memory and offloading")
    for flag in ("--quant", "--draft-quant", "--offload", "--gpu-budget", "--ram-budget", "--cache-dir"):
        add_flag(g, flag)
    if context_list:                              # bench: a sweep (cli/bench/context.py); the plan takes the largest
        add_flag(g, "--context", "", "run the prompts after a long shared document filling each of these "
                 "contexts, e.g. 1k,8k,32k: one table of tok/s, tokens per pass, prefill and pass seconds by "
                 "context (the memory plan reserves KV cache for the largest)", type=str, metavar="LIST")
    else:
        add_flag(g, "--context")
    add_flag(g, "--kv-offload")
    add_flag(g, "--draft-layers")
    add_flag(g, "--experts")


def add_common_args(p: argparse.ArgumentParser, max_new_default: str = "128", model_required: bool = True,
                    context_list: bool = False) -> None:
    """Every shared group, in --help order: model, engine, sampling, offload (--context a list: the bench)."""
    add_model_args(p, model_required)
    add_engine_args(p, max_new_default)
    add_sampling_args(p)
    add_offload_args(p, context_list)


def default_device() -> str:
    """The device a run takes without --device: CUDA where torch sees one (`plan` too), else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(args: argparse.Namespace, auto_budget: bool = False, **defaults) -> EngineConfig:
    """EngineConfig from the engine flags; `defaults` fill flags the user left out; auto_budget: a run with no
    --budget picks its budget per step (generate, chat, serve, bench), else it takes EngineConfig's fixed one."""
    given = {k: getattr(args, k, None) for k in ("builder", "device", "dtype", "max_new_tokens", "kv_quant",
                                                 "expert_trim", "gate")}
    given_budget = getattr(args, "budget", None)
    budget = budget_options("auto" if given_budget is None and auto_budget else given_budget,
                            getattr(args, "max_budget", None))
    if getattr(args, "accept", None) is not None:
        given["accept"] = parse_accept(args.accept)
    defaults.setdefault("device", default_device())
    return EngineConfig(**{**defaults, **{k: v for k, v in given.items() if v is not None}, **budget})


def target_reserve(args: argparse.Namespace) -> Reserve | None:
    """The layer cache the plan builds for the target, from the command's offload and engine flags (None when
    the flags are invalid: the command reports that itself)."""
    from specexec.planning.disk_need import reserve_for

    try:
        return reserve_for(offload_config(args), engine_config(args))
    except ConfigError:
        return None


def refuse_lossy_kv(config: EngineConfig, command: str) -> None:
    """Benchmarks that check exactness take no lossy cache (--kv-quant int8 belongs to `specexec bench`) and no
    relaxed acceptance (`specexec bench relaxed` measures it)."""
    if config.accept.relaxed:
        raise ConfigError(f"{command} measures on the target's own text; --accept {config.accept.label} is lossy: "
                          "drop it (`specexec bench relaxed` measures what it costs)")
    if config.kv_quant != "none":
        raise ConfigError(f"{command} checks that outputs are exact; --kv-quant {config.kv_quant} is lossy: drop it "
                          "(`specexec bench --kv-quant int8` reports its effect)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags (defaults for the ones left out)."""
    given = {f.name: getattr(args, f.name, None) for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in given.items() if v is not None})


def offload_config(args: argparse.Namespace, context: int | None = None) -> OffloadConfig:
    """OffloadConfig from the offload flags; `context` replaces --context (the bench's largest context)."""
    return OffloadConfig.from_flags(quant=getattr(args, "quant", None), offload=getattr(args, "offload", None),
                                    draft_quant=getattr(args, "draft_quant", None),
                                    gpu_budget=getattr(args, "gpu_budget", None),
                                    ram_budget=getattr(args, "ram_budget", None),
                                    cache_dir=getattr(args, "cache_dir", None),
                                    context=context if context is not None else getattr(args, "context", None),
                                    kv_offload=getattr(args, "kv_offload", None),
                                    draft_layers=getattr(args, "draft_layers", None),
                                    experts=getattr(args, "experts", None))


def apply_catalog_defaults(args: argparse.Namespace, console: Console | None = None) -> None:
    """Bring the target onto this machine (a Hub id or models.yaml name is downloaded when not cached, see
    cli/fetch.py), then for a models.yaml name use its recommended draft (unless --draft/--no-draft), default
    budget and quantization (unless given), then bring the draft. A directory path is never looked up."""
    from specexec.checkpoints.catalog import find

    entry = find(args.model)
    fetch_model(args, "model", target_reserve(args))
    if entry is not None:
        _entry_defaults(args, entry, console)
    if not getattr(args, "no_draft", False) and not is_self_draft(getattr(args, "draft", None)):
        fetch_model(args, "draft")


def _entry_defaults(args: argparse.Namespace, entry, console: Console | None) -> None:
    notes = []
    if not args.draft and not args.no_draft and not getattr(args, "drafts", None) and entry.drafts:
        args.draft = entry.drafts[0]
        notes.append(f"draft {entry.drafts[0]}")
    if getattr(args, "budget", None) is None and "budget" in vars(args):
        args.budget = entry.budget
        notes.append(f"budget {entry.budget}")
    if getattr(args, "quant", None) is None and "quant" in vars(args) and entry.quant != "none":
        args.quant = entry.quant
        notes.append(f"quant {entry.quant}")
    if notes and console is not None:
        console.print(f"{entry.name}: using the models.yaml defaults: {', '.join(notes)}", style="dim",
                      highlight=False)


def check_target(args: argparse.Namespace) -> None:
    """--model names a checkpoint on this machine (checkpoints/loading.check_model_path), checked after every
    flag's value (a bad value is reported even with a wrong path) and before the draft the builder needs (a
    mistyped path is reported as such, not as a missing draft)."""
    from specexec.checkpoints.loading import check_model_path

    if args.model:
        check_model_path(args.model)


def check_draft(args: argparse.Namespace, config: EngineConfig, default_self: bool = False) -> bool:
    """--draft/--no-draft against the builder. default_self (chat): no draft named and none recommended means
    a drafter the model's own checkpoint carries when it has one (drafters/registry.offered_kind: its MTP layer,
    args.draft = "mtp"), else the self-draft ("self"), shown in the plan, instead of a refusal; returns whether
    it did so."""
    from specexec.drafters.registry import offered_kind
    from specexec.runtime.self_draft import SELF

    needs = builder_needs_draft(config.builder)          # an unknown --builder is said before the path
    check_target(args)
    chosen = default_self and not args.draft and not args.no_draft and needs
    if chosen:
        kind = offered_kind(args.model)
        args.draft = kind.name if kind is not None else SELF
    check_draft_choice(args.draft, args.no_draft, config.builder, needs)
    return chosen


def print_plan(console: Console) -> Callable[[TargetPlan], None]:
    """Runtime.load's on_plan: the memory ledger (or only the plan's warnings) on `console`, before loading."""
    def show(plan: TargetPlan) -> None:
        notice = plan.notice()
        if notice:
            console.print(notice, highlight=False, markup=False)
    return show


def prompt_cache_size(args: argparse.Namespace) -> int:
    """--prompt-cache's bytes (0: off), checked before anything loads."""
    return parse_size(args.prompt_cache, "--prompt-cache") if getattr(args, "prompt_cache", None) else 0


def attach_prompt_cache(args: argparse.Namespace, runtime: Runtime, console: Console | None) -> None:
    """--prompt-cache SIZE: the runtime's prefix cache under <--cache-dir or the cache root>/prefix/ (0: none);
    its one-line warnings go to `console`."""
    size = prompt_cache_size(args)
    if not size:
        return
    from specexec.runtime import prompt_cache

    root = Path(args.cache_dir) if getattr(args, "cache_dir", None) else None
    warn = (lambda line: console.print(line, style="yellow", highlight=False, markup=False)) if console else \
        (lambda line: print(line, file=sys.stderr))
    directory = "auto" if root is None else root / "prefix" / prompt_cache.kv_fingerprint(runtime)
    prompt_cache.attach(runtime, size, directory, warn)


def load_runtime(args: argparse.Namespace, config: EngineConfig, console: Console | None,
                 offload: OffloadConfig | None = None, spinner: bool = True) -> Runtime:
    """Runtime.load with the memory ledger printed on `console` before anything loads and a transient spinner
    while loading (spinner=False: none, e.g. for logs); console None: silently."""
    from specexec.runtime.assembly import Runtime

    draft = None if args.no_draft else args.draft
    if console is None:
        return Runtime.load(args.model, draft, config, args.allow_pickle, offload=offload)
    if not spinner:
        return Runtime.load(args.model, draft, config, args.allow_pickle, offload=offload,
                            on_plan=print_plan(console))
    with console.status("loading") as status:
        return Runtime.load(args.model, draft, config, args.allow_pickle, progress=lambda msg: status.update(msg),
                            offload=offload, on_plan=print_plan(console))
