"""`specexec bench`: the end-to-end benchmark. A fixed prompt set goes through several configurations in ONE
run, and a comparison table (plus `--json`: one line {"rows": [...]}) says how they did.

Configurations: `specexec budget=N` for each of --budgets, `no-draft` (the same runtime decoding with the
target alone), and, when transformers + accelerate are installed, `hf-offload` (transformers generate() with
a device_map under the same memory limits) and `hf-assisted` (transformers assisted generation with the same
draft), and, when llama-cpp-python is installed (or --configs names it), `llama.cpp` (llama.cpp on the GGUF of
--gguf or --model, same prompt ids, max tokens and threads, plus its prompt-lookup speculative row:
cli/bench/llamacpp.py; skipped with one line without the package or a GGUF). Our models load once and every
specexec/no-draft configuration is a Runtime.variant of them; the transformers models load once, after ours are
released, and serve both hf-* rows. Before each prompt the KV
cache is reset, so every configuration prefills every prompt. Prompts are encoded through the chat template
(when the model has one) and left-truncated, with a warning, to fit the context minus --max-new-tokens.

Per row: tok_s = new tokens / decode seconds summed over prompts (decode = wall time after the prefill pass,
so the first pass counts for specexec and for transformers alike); tokens_per_pass = new tokens / target
forward passes (transformers: the prompt's pass too, since it emits a token); ttft_s = mean time to first
token; peak RAM = process RSS during the row (sampled), peak VRAM = torch's CUDA peak; identical_to_baseline
(temperature 0 only, vs no-draft) = every prompt's token ids equal, with `identical_prompts` "k/n" and
`first_mismatch` (per prompt, the first new token that differs; null where identical); our rows also give
draft_ms_per_step and target_ms_per_step (the profiler's, averaged over steps).

Drafts: --draft X (or --no-draft), or --drafts LIST to compare several on one target, e.g. `--drafts PATH,self`:
each draft loads in turn with the target (planned for it) and gets its own specexec rows, named `LABEL
budget=N` (LABEL: `self[:FMT]` for the self-draft, the checkpoint's directory name when several model drafts
are compared, else `specexec`); no-draft and the hf-* rows run once (hf-assisted with the first model draft).
Each row's JSON says its `draft`.

With --kv-quant int8 every specexec/no-draft row runs again with an int8 KV cache beside the exact ones (the
runtime is planned for the exact cache): those rows are marked LOSSY, never called identical, and say where
each prompt's output first diverges from the exact target alone. With --context 1k,8k,32k the prompts follow a
long shared document filling each context instead, and one table gives the cost of context
(cli/bench/context.py).

With --endpoint URL the same prompt set and table measure OpenAI-compatible servers instead (cli/bench/endpoint.py);
--plot FILE draws the rows (cli/bench/plot.py); the rows and the table are cli/bench/table.py's.

Does not know: how a step works (specexec.decoding.engine), how flags are validated (specexec.options), how models load
(specexec.runtime.assembly; transformers for the hf-* rows).
"""
from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

from rich.console import Console

from cli import args as common
from cli.bench.progress import PromptBars
from specexec.config import EngineConfig
from specexec.options import (ConfigError, budget_options, check_choice, check_number, is_self_draft,
                              parse_budget_list)
from specexec.prompts import load_prompts

CONFIG_KINDS = ("specexec", "no-draft", "hf-offload", "hf-assisted", "llama.cpp")
DEFAULT_BUDGETS = "16,64,256,auto"
LOSSY_TAG = " kv=int8 LOSSY"        # --kv-quant int8: rows with an int8 KV cache, never called identical


DESCRIPTION = ("Run a prompt set through specexec at several budgets, the target alone and (when installed) "
               "transformers offload and assisted generation in one run; print a comparison table.")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The end-to-end bench's flags (on the `bench` group parser, see cli/main.py): generate's model, engine,
    sampling and offload flags plus the bench's own."""
    common.add_common_args(p, max_new_default="128", model_required=False, context_list=True)
    budget = next(a for a in p._actions if "--budget" in a.option_strings)
    budget.help = f"one tree budget N or auto instead of the --budgets sweep (default: the sweep, {DEFAULT_BUDGETS})"
    p.add_argument("--drafts", metavar="LIST", help="compare several drafts on the one target, comma-separated: "
                   "checkpoints, models.yaml names and self[:FMT] (the target's own layers; --draft-layers applies "
                   "to it), e.g. PATH,self; instead of --draft")
    p.add_argument("--budgets", metavar="LIST", help=f"tree budgets to sweep, e.g. {DEFAULT_BUDGETS} (default; "
                   "--budget N alone means just N)")
    p.add_argument("--configs", metavar="LIST", help=f"which to run, comma-separated from {', '.join(CONFIG_KINDS)} "
                   "(default: all; hf-* only when transformers + accelerate are installed)")
    p.add_argument("--gguf", metavar="PATH", help="the llama.cpp rows' model: the target as a GGUF file (default: "
                   "--model itself when it is a .gguf); the rows need llama-cpp-python (pip install "
                   "'specexec[llamacpp]')")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts, one {\"prompt\": ...} per line (default: the "
                   "built-in 40: chat, code, reasoning, summarisation)")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N prompts")
    p.add_argument("--warmup", type=int, default=4, metavar="N",
                   help="tokens of an untimed warm-up generation per configuration (default 4; 0 = none)")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="run our configurations N rounds, "
                   "round-robin, and keep each one's fastest round (default 1; more evens out a noisy machine)")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"rows\": [...]} to stdout "
                   "(the table goes to stderr)")
    p.add_argument("--endpoint", metavar="URL", action="append", help="measure an OpenAI-compatible server "
                   "instead (specexec serve, vLLM, SGLang; repeat for several): same prompts and table; --model "
                   "is then the served model name (default: the first /v1/models lists)")
    p.add_argument("--api-key", metavar="K", help="with --endpoint: the server's API key (default $OPENAI_API_KEY)")
    p.add_argument("--plot", metavar="FILE", help="also draw tok/s and tokens per pass against the budget, "
                   "baselines as lines, into FILE.png or FILE.svg (needs matplotlib: pip install -e '.[plot]')")


# -------------------------------------------------------------------- plan

def _auto_budget_supported() -> bool:
    return "auto_budget" in {f.name for f in fields(EngineConfig)}


def hf_available() -> bool:
    """transformers + accelerate importable (the hf-* rows need both)."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))


def _kinds(text: str | None, has_draft: bool, has_model_draft: bool | None = None) -> tuple[str, ...]:
    """The configurations to run: --configs, else all that can (hf-* need transformers + accelerate;
    specexec a draft; hf-assisted a draft model, not the self-draft)."""
    from cli.bench import llamacpp
    model = has_draft if has_model_draft is None else has_model_draft
    needs = {"specexec": has_draft, "hf-assisted": model, "llama.cpp": llamacpp.available()}
    if text is None:
        kinds = [k for k in CONFIG_KINDS if hf_available() or not k.startswith("hf-")]
        return tuple(k for k in kinds if needs.get(k, True))
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for k in kinds:
        check_choice("--configs", k, CONFIG_KINDS)
        if k.startswith("hf-") and not hf_available():
            raise ConfigError(f"--configs {k} needs transformers and accelerate: pip install accelerate")
        if k in ("specexec", "hf-assisted") and not has_draft:
            raise ConfigError(f"--configs {k} needs a draft model: pass --draft PATH (or drop {k})")
        if k == "hf-assisted" and not model:
            raise ConfigError("--configs hf-assisted needs a draft model (transformers cannot draft with the "
                              "target's own layers): add one to --drafts, or drop hf-assisted")
    if not kinds:
        raise ConfigError("--configs lists no configuration")
    return tuple(dict.fromkeys(kinds))


def make_plan(args: argparse.Namespace) -> Plan:
    from cli.bench.common import Plan
    from cli.bench.context import parse_contexts
    from cli.bench.table import EXTERNAL

    if not args.model:
        raise ConfigError("bench needs --model PATH|NAME (and --draft PATH, or --no-draft)")
    config = common.engine_config(args)
    sampling = common.sampling_params(args)
    contexts = parse_contexts(args.context) if args.context else ()
    offload = common.offload_config(args, max(contexts) if contexts else None)
    drafts = _drafts(args)
    if getattr(args, "drafts", None) is None:          # --drafts names drafts only (each checked as it loads)
        common.check_draft(args, config)
    budgets_text = args.budgets or (str(args.budget) if args.budget is not None else DEFAULT_BUDGETS)
    budgets = parse_budget_list(budgets_text, _auto_budget_supported())
    kinds = _kinds(args.configs, bool(drafts), any(not is_self_draft(d) for d in drafts))
    if contexts:                                   # the context sweep measures our runtime only
        if args.configs and any(k.startswith(EXTERNAL) for k in kinds):
            raise ConfigError("--context runs specexec and no-draft only; drop the hf-* and llama.cpp rows from "
                              "--configs")
        kinds = tuple(k for k in kinds if not k.startswith(EXTERNAL))
    if sampling.presence_penalty or sampling.frequency_penalty:      # transformers has no such logits processor
        if args.configs and any(k.startswith(EXTERNAL) for k in kinds):
            raise ConfigError("--presence-penalty/--frequency-penalty: transformers' generate() has no such "
                              "penalty (llama.cpp's differs), so those rows would decode something else; drop the "
                              "hf-* and llama.cpp rows from --configs")
        kinds = tuple(k for k in kinds if not k.startswith(EXTERNAL))
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        check_number("--limit", args.limit, low=1, high=10**6)
        prompts = prompts[:args.limit]
    check_number("--warmup", args.warmup, low=0, high=10**4)
    check_number("--repeat", args.repeat, low=1, high=100)
    return Plan(config, sampling, offload, budgets, args.max_budget, kinds, tuple(prompts), args.repeat,
                contexts=contexts, drafts=drafts)


def _drafts(args: argparse.Namespace) -> tuple[str, ...]:
    """--drafts LIST, else --draft (() with --no-draft or none)."""
    if getattr(args, "drafts", None) is None:
        return (args.draft,) if args.draft and not args.no_draft else ()
    if args.draft or args.no_draft:
        raise ConfigError("--drafts lists every draft: leave out --draft/--no-draft")
    drafts = tuple(dict.fromkeys(d.strip() for d in args.drafts.split(",") if d.strip()))
    if not drafts:
        raise ConfigError("--drafts lists no draft")
    return drafts


def draft_label(spec: str, drafts: tuple[str, ...]) -> str:
    """A draft's name in row names: self[:FMT] as given; a model draft `specexec` when it is the only model
    draft, else its checkpoint's directory name."""
    if is_self_draft(spec):
        return spec.strip()
    several = sum(not is_self_draft(d) for d in drafts) > 1
    return Path(spec).name if several else "specexec"


# -------------------------------------------------------------------- our runtime

def run_ours(runtime: Runtime, plan: Plan, prompt_ids: list[list[int]], warmup: int,
             progress: Callable[[str], None], done: Callable[[Result], None] = lambda r: None,
             draft: str | None = None) -> list[Result]:
    """Every specexec budget and no-draft, each on a variant of the one loaded runtime (made when its turn
    comes, so only one set of KV caches exists at a time); plan.repeat rounds round-robin, so a slow spell of a
    shared machine hits every configuration alike, and each keeps its fastest round. draft: the runtime's
    draft as given (names the specexec rows, draft_label)."""
    from cli.bench.common import Result
    from cli.bench.common import config_name
    from cli.bench.common import run_variant

    todo: list[tuple[str, int | str | None, str]] = []
    label = draft_label(draft, plan.drafts) if draft else "specexec"
    for kv in ["none"] + (["int8"] if plan.config.kv_quant == "int8" else []):   # int8: LOSSY rows beside
        tag = "" if kv == "none" else LOSSY_TAG
        if "specexec" in plan.kinds:
            todo += [(config_name("specexec", b, plan.config.builder, label) + tag, b, kv) for b in plan.budgets]
        if "no-draft" in plan.kinds:
            todo.append(("no-draft" + tag, None, kv))
    best: dict[str, Result] = {}
    for round_ in range(plan.repeat):
        for name, budget, kv in todo:
            config = plan.config.replace(kv_quant=kv)
            if budget is None:
                rt = runtime.variant(config, use_draft=False)
            else:
                rt = runtime.variant(config.replace(**{"auto_budget": False,
                                                       **budget_options(budget, plan.max_budget)}))
            label = name if plan.repeat == 1 else f"{name} (round {round_ + 1}/{plan.repeat})"
            res = run_variant(label, rt, budget, plan, prompt_ids, warmup, progress)
            done(res)
            res.config, res.lossy, res.draft = name, kv != "none", (draft if budget is not None else None)
            if name not in best or (res.tok_s or 0) > (best[name].tok_s or 0):
                best[name] = res
            del rt
    return [best[name] for name, _, _ in todo]


def release(runtime: Runtime) -> None:
    """Stop an offloaded target's loader thread so its buffers can go before the transformers models load."""
    runtime.engine.close()                        # the target's own close(), when it has one (model.Closes)
    gc.collect()


# -------------------------------------------------------------------- entry point

def swept(plan: Plan) -> str:
    """What this runtime sweeps, for the header: the budgets (the runtime's own budget is only where they start)
    and the target alone; the baselines' rows (transformers, llama.cpp) say their own lines when they run."""
    rows = ([f"budgets {', '.join(map(str, plan.budgets))}"] if "specexec" in plan.kinds else []) + \
        [k for k in plan.kinds if k == "no-draft"]
    return f"sweeping {len(plan.prompts)} prompts over " + (", ".join(rows) or "nothing")


def _done_line(console: Console) -> Callable[[Result], None]:
    """One dim line per finished configuration (long runs show progress in a log file too)."""
    from cli.bench.common import Result
    from cli.bench.table import per_step

    def done(r: Result) -> None:
        from cli.bench.table import per_step

        rate = f"{r.tok_s:.2f} tok/s" if r.tok_s else "– tok/s"
        draft, target = per_step(r, r.draft_s), per_step(r, r.target_s)
        steps = f" · per step: draft {draft:.0f} ms, target {target:.0f} ms" if draft is not None else ""
        console.print(f"done {r.config}: {r.new_tokens} tokens · {rate} · {r.passes} target passes{steps}",
                      style="dim", highlight=False, markup=False)
    return done


def _run_contexts(args: argparse.Namespace, runtime: Runtime, plan: Plan, console: Console) -> int:
    """bench --context: the context sweep (cli/bench/context.py), one table, `--json` one line {"rows": [...]}."""
    from cli.bench.common import wide
    from cli.bench.context import context_rows
    from cli.bench.context import context_table
    from cli.bench.context import run_contexts

    with console.status("benchmarking") as status:
        results = run_contexts(runtime, plan, plan.contexts, args.raw, lambda msg: status.update(msg))
    release(runtime)
    rows = context_rows(results, plan.sampling.greedy)
    title = (f"{len(plan.prompts)} prompts after a shared document · up to {plan.config.max_new_tokens} new tokens "
             f"· temperature {plan.sampling.temperature} · {plan.config.device}")
    out = wide(console if args.json else Console(soft_wrap=True))
    out.print(context_table(rows, title))
    if args.json:
        print(json.dumps({"rows": rows, "contexts": list(plan.contexts), "prompts": len(plan.prompts),
                          "max_new_tokens": plan.config.max_new_tokens, "temperature": plan.sampling.temperature,
                          "device": plan.config.device, "dtype": plan.config.dtype}, separators=(",", ":")),
              flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from cli.bench import llamacpp, plot
    from cli.bench.common import wide
    from cli.bench.hf import run_hf
    from cli.bench.table import BASELINES, cannot_pay
    from cli.bench.table import gate_lines
    from cli.bench.table import make_rows
    from cli.bench.table import make_table

    if args.endpoint:
        from cli.bench import endpoint as bench_endpoint
        return bench_endpoint.run(args)
    console = Console(stderr=True, soft_wrap=True)
    figure = plot.check_target(args.plot)
    common.apply_catalog_defaults(args, console)
    plan = make_plan(args)
    if plan.contexts:
        from cli.generate import print_load_summary

        runtime = common.load_runtime(args, plan.config.replace(kv_quant="none"), console, plan.offload)
        print_load_summary(console, runtime)
        return _run_contexts(args, runtime, plan, console)
    ours, prompt_ids, hf = run_drafts(args, plan, console)
    results = [r for r in ours if r.config not in BASELINES] + [r for r in ours if r.config in BASELINES]
    with PromptBars(console) as bars:
        results += run_hf(hf[0], hf[1], plan, prompt_ids, hf[2], hf[3], args.warmup, bars, _done_line(console))
        if "llama.cpp" in plan.kinds:
            skip = llamacpp.skip_reason(args.model, args.gguf)
            if skip:
                console.print(skip, style="yellow", highlight=False, markup=False)
            else:
                results += llamacpp.run_llamacpp(llamacpp.gguf_for(args.model, args.gguf), plan, prompt_ids, hf[2],
                                                 args.warmup, bars, _done_line(console),
                                                 lambda line: console.print(line, style="yellow", highlight=False,
                                                                            markup=False))
    rows = make_rows(results, plan.sampling.greedy)
    title = (f"{len(prompt_ids)} prompts · up to {plan.config.max_new_tokens} new tokens · temperature "
             f"{plan.sampling.temperature} · {plan.config.device}")
    out = wide(console if args.json else Console(soft_wrap=True))
    out.print(make_table(rows, title))
    if (why := cannot_pay(rows)) is not None:
        out.print(why, highlight=False, markup=False, style="yellow")
    for r in rows:
        if r["budget_trace"]:
            out.print(f"{r['config']}: budget per step {r['budget_trace']}", highlight=False, markup=False)
        for line in gate_lines(r):                       # --gate: when and why drafting switched
            out.print(line, highlight=False, markup=False)
    if figure is not None:
        plot.save(plot.bench_figure(rows, title), figure, rows, title)
        console.print(f"plot written to {figure}", style="dim", highlight=False)
    if args.json:
        print(json.dumps({"rows": rows, "prompts": len(prompt_ids), "max_new_tokens": plan.config.max_new_tokens,
                          "temperature": plan.sampling.temperature, "device": plan.config.device,
                          "dtype": plan.config.dtype, "model": str(hf[0]), "draft": str(hf[1]) if hf[1] else None,
                          "drafts": list(plan.drafts)}, separators=(",", ":")), flush=True)
    return 0


def run_drafts(args: argparse.Namespace, plan: Plan, console: Console) -> tuple[list[Result], list[list[int]], tuple]:
    """Our rows: the target with each draft in turn (loaded, planned and released one after the other), the
    baselines with the first. Returns (results, prompt ids, the hf rows' arguments: target path, first model
    draft's path, eos ids, pad id)."""
    from cli.bench.common import Result
    from cli.bench.common import encode_prompts

    from cli.fetch import fetch_model
    from cli.generate import print_load_summary

    results: list[Result] = []
    prompt_ids: list[list[int]] = []
    target_path = draft_path = eos = pad = None
    for k, spec in enumerate(plan.drafts or (None,)):
        if plan.drafts:
            args.draft = spec
            if not is_self_draft(spec):
                fetch_model(args, "draft")
        exact = plan.config.replace(kv_quant="none")   # planned for the exact cache; int8 rows are variants of it
        runtime = common.load_runtime(args, exact, console, plan.offload)
        print_load_summary(console, runtime, swept(plan))
        if k == 0:
            warn = lambda msg: console.print(f"warning: {msg}", style="yellow", highlight=False,  # noqa: E731
                                             markup=False)
            prompt_ids = encode_prompts(runtime, plan.prompts, plan.config.max_new_tokens, args.raw, warn)
            eos, pad = sorted(runtime.engine.eos_ids), runtime.tokenizer.pad_token_id
            target_path = runtime.target_info.path
        if draft_path is None and spec is not None and not is_self_draft(spec):
            draft_path = runtime.draft_info.path
        kinds = plan.kinds if k == 0 else tuple(x for x in plan.kinds if x == "specexec")
        planned = ((len(plan.budgets) if "specexec" in kinds else 0) + ("no-draft" in kinds)) * plan.repeat * (
            2 if plan.config.kv_quant == "int8" else 1)         # the configurations run_ours goes through
        with PromptBars(console, planned) as bars:
            results += run_ours(runtime, replace(plan, kinds=kinds), prompt_ids, args.warmup, bars,
                                _done_line(console), draft=spec)
        release(runtime)
        del runtime
        gc.collect()
    return results, prompt_ids, (target_path, draft_path, eos, pad)
