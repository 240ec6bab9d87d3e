"""`specexec bench`: the end-to-end benchmark. A fixed prompt set goes through several configurations in ONE
run, and a comparison table (plus `--json`: one line {"rows": [...]}) says how they did.

Configurations: `specexec budget=N` for each of --budgets, `no-draft` (the same runtime decoding with the
target alone), and, when transformers + accelerate are installed, `hf-offload` (transformers generate() with
a device_map under the same memory limits) and `hf-assisted` (transformers assisted generation with the same
draft). Our models load once and every specexec/no-draft configuration is a Runtime.variant of them; the
transformers models load once, after ours are released, and serve both hf-* rows. Before each prompt the KV
cache is reset, so every configuration prefills every prompt. Prompts are encoded through the chat template
(when the model has one) and left-truncated, with a warning, to fit the context minus --max-new-tokens.

Per row: tok_s = new tokens / decode seconds summed over prompts (decode = wall time after the prefill pass,
so the first pass counts for specexec and for transformers alike); tokens_per_pass = new tokens / target
forward passes (transformers: the prompt's pass too, since it emits a token); ttft_s = mean time to first
token; peak RAM = process RSS during the row (sampled), peak VRAM = torch's CUDA peak; identical_to_baseline
(temperature 0 only, vs no-draft) = every prompt's token ids equal, with `identical_prompts` "k/n" and
`first_mismatch` (per prompt, the first new token that differs; null where identical).

Does not know: how a step works (specexec.engine), how flags are validated (specexec.config), how models load
(specexec.runtime; transformers for the hf-* rows).
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from rich.console import Console
from rich.table import Table

from cli import args as common
from specexec.config import (ConfigError, EngineConfig, OffloadConfig, SamplingParams, budget_options,
                             check_number, parse_budget_list)
from specexec.profiler import PeakMemory, Profiler
from specexec.prompts import Prompt, load_prompts
from specexec.runtime import Runtime

CONFIG_KINDS = ("specexec", "no-draft", "hf-offload", "hf-assisted")
BASELINES = ("no-draft", "hf-offload", "hf-assisted")
DEFAULT_BUDGETS = "16,64,256"
WARMUP_PROMPT = "Hello"


DESCRIPTION = ("Run a prompt set through specexec at several budgets, the target alone and (when installed) "
               "transformers offload and assisted generation in one run; print a comparison table.")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The end-to-end bench's flags (on the `bench` group parser, see cli/main.py): generate's model, engine,
    sampling and offload flags plus the bench's own."""
    common.add_common_args(p, max_new_default="128", model_required=False)
    p.add_argument("--budgets", metavar="LIST", help=f"tree budgets to sweep, e.g. {DEFAULT_BUDGETS} (default; "
                   "--budget N alone means just N)")
    p.add_argument("--configs", metavar="LIST", help=f"which to run, comma-separated from {', '.join(CONFIG_KINDS)} "
                   "(default: all; hf-* only when transformers + accelerate are installed)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts, one {\"prompt\": ...} per line (default: the "
                   "built-in 40: chat, code, reasoning, summarisation)")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N prompts")
    p.add_argument("--warmup", type=int, default=4, metavar="N",
                   help="tokens of an untimed warm-up generation per configuration (default 4; 0 = none)")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"rows\": [...]} to stdout "
                   "(the table goes to stderr)")


# -------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Plan:
    """Everything the bench will do, checked before any model loads."""

    config: EngineConfig
    sampling: SamplingParams
    offload: OffloadConfig
    budgets: tuple[int | str, ...]
    max_budget: int | None
    kinds: tuple[str, ...]
    prompts: tuple[Prompt, ...]


def _auto_budget_supported() -> bool:
    return "auto_budget" in {f.name for f in fields(EngineConfig)}


def hf_available() -> bool:
    """transformers + accelerate importable (the hf-* rows need both)."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))


def _kinds(text: str | None, has_draft: bool) -> tuple[str, ...]:
    if text is None:
        kinds = [k for k in CONFIG_KINDS if hf_available() or not k.startswith("hf-")]
        return tuple(k for k in kinds if has_draft or k not in ("specexec", "hf-assisted"))
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    for k in kinds:
        if k not in CONFIG_KINDS:
            raise ConfigError(f"--configs: unknown configuration {k!r}; choose from: {', '.join(CONFIG_KINDS)}")
        if k.startswith("hf-") and not hf_available():
            raise ConfigError(f"--configs {k} needs transformers and accelerate: pip install accelerate")
        if k in ("specexec", "hf-assisted") and not has_draft:
            raise ConfigError(f"--configs {k} needs a draft model: pass --draft PATH (or drop {k})")
    if not kinds:
        raise ConfigError("--configs lists no configuration")
    return tuple(dict.fromkeys(kinds))


def make_plan(args: argparse.Namespace) -> Plan:
    if not args.model:
        raise ConfigError("bench needs --model PATH|NAME (and --draft PATH, or --no-draft)")
    config = common.engine_config(args)
    sampling = common.sampling_params(args)
    offload = common.offload_config(args)
    common.check_draft(args, config)
    budgets_text = args.budgets or (str(args.budget) if args.budget is not None else DEFAULT_BUDGETS)
    budgets = parse_budget_list(budgets_text, _auto_budget_supported())
    kinds = _kinds(args.configs, bool(args.draft) and not args.no_draft)
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        check_number("--limit", args.limit, low=1, high=10**6)
        prompts = prompts[:args.limit]
    check_number("--warmup", args.warmup, low=0, high=10**4)
    return Plan(config, sampling, offload, budgets, args.max_budget, kinds, tuple(prompts))


# -------------------------------------------------------------------- results

@dataclass
class Result:
    """One configuration over all prompts."""

    config: str
    outputs: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    passes: int = 0
    decode_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    peak_ram: int = 0
    peak_vram: int | None = None
    budget: int | str | None = None
    builder: str | None = None
    note: str = ""

    def add(self, ids: list[int], passes: int, decode_s: float, ttft_s: float | None) -> None:
        self.outputs.append(list(ids))
        self.new_tokens += len(ids)
        self.passes += passes
        self.decode_s += decode_s
        if ttft_s is not None:
            self.ttfts.append(ttft_s)

    @property
    def tok_s(self) -> float | None:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else None


def encode_prompts(runtime: Runtime, prompts: tuple[Prompt, ...], max_new: int, raw: bool,
                   warn: Callable[[str], None]) -> list[list[int]]:
    """Prompt ids (chat template unless raw or absent), left-truncated to fit context - max_new."""
    chat = not raw and bool(getattr(runtime.tokenizer, "chat_template", None))
    room = runtime.context - max_new
    if room < 1:
        raise ConfigError(f"--max-new-tokens {max_new} leaves no room for a prompt in the context of "
                          f"{runtime.context} tokens")
    out = []
    for p in prompts:
        ids = runtime.encode(p.prompt, chat=chat, system=p.system if chat else None)
        if len(ids) > room:
            warn(f"prompt {p.id}: {len(ids)} tokens, left-truncated to {room} to fit the context of "
                 f"{runtime.context} with --max-new-tokens {max_new}")
            ids = ids[-room:]
        out.append(ids)
    return out


def config_name(kind: str, budget: int | str | None = None, builder: str = "specexec") -> str:
    if kind != "specexec":
        return kind
    return f"specexec budget={budget}" + (f" builder={builder}" if builder != "specexec" else "")


# -------------------------------------------------------------------- our runtime

def run_ours(runtime: Runtime, plan: Plan, prompt_ids: list[list[int]], warmup: int,
             progress: Callable[[str], None], done: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Every specexec budget and no-draft, each on a variant of the one loaded runtime (made when its turn
    comes, so only one set of KV caches exists at a time)."""
    todo: list[tuple[str, int | str | None]] = []
    if "specexec" in plan.kinds:
        todo += [(config_name("specexec", b, plan.config.builder), b) for b in plan.budgets]
    if "no-draft" in plan.kinds:
        todo.append(("no-draft", None))
    results = []
    for name, budget in todo:
        if budget is None:
            rt = runtime.variant(plan.config, use_draft=False)
        else:
            rt = runtime.variant(plan.config.replace(**{"auto_budget": False,
                                                        **budget_options(budget, plan.max_budget)}))
        results.append(_run_variant(name, rt, budget, plan, prompt_ids, warmup, progress))
        done(results[-1])
        del rt
    return results


def release(runtime: Runtime) -> None:
    """Stop an offloaded target's loader thread so its buffers can go before the transformers models load."""
    close = getattr(runtime.engine.target, "close", None)
    if callable(close):
        close()
    gc.collect()


def _run_variant(name: str, rt: Runtime, budget: int | str | None, plan: Plan, prompt_ids: list[list[int]],
                 warmup: int, progress: Callable[[str], None]) -> Result:
    max_new = plan.config.max_new_tokens
    if warmup:
        rt.engine.reset()
        for _ in rt.generate_ids(rt.encode(WARMUP_PROMPT), warmup, plan.sampling):
            pass
    res = Result(name, budget=budget, builder=rt.builder_name if budget is not None else None)
    with PeakMemory(rt.engine.device) as mem:
        for j, ids in enumerate(prompt_ids, 1):
            progress(f"{name} · prompt {j}/{len(prompt_ids)}")
            rt.engine.reset()
            out = [t for step in rt.generate_ids(ids, max_new, plan.sampling) for t in step]
            s = rt.engine.profiler.summary()
            res.add(out, s["steps"], s["decode_s"] or 0.0, s["ttft_s"])
    res.peak_ram, res.peak_vram = mem.ram_bytes, mem.vram_bytes
    return res


# -------------------------------------------------------------------- transformers baselines

def _hf_dtype_kw(dtype: torch.dtype) -> dict:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def hf_placement(offload: OffloadConfig, n_layers: int, device: str, folder: str) -> dict:
    """from_pretrained kwargs that put the target where our --offload/--*-budget flags put ours: every layer on
    `disk` for ssd, in CPU RAM for ram (on CUDA), accelerate's device_map='auto' under max_memory for the
    budgets, else everything on the device."""
    dev = "cpu" if device == "cpu" else (0 if device == "cuda" else int(device.split(":")[1]))
    tier = {"ssd": "disk", "ram": "cpu"}.get(offload.offload)
    if tier is not None and not (tier == "cpu" and dev == "cpu"):
        dmap = {"model.embed_tokens": dev, "model.norm": dev, "model.rotary_emb": dev, "lm_head": dev}
        dmap.update({f"model.layers.{i}": tier for i in range(n_layers)})
        return {"device_map": dmap, "offload_folder": folder}
    budgets = {k: v for k, v in ((dev, offload.gpu_budget if dev != "cpu" else offload.ram_budget),
                                 ("cpu", offload.ram_budget)) if v is not None}
    if budgets:
        return {"device_map": "auto", "max_memory": budgets, "offload_folder": folder}
    return {"device_map": {"": dev}}


class _FirstToken:
    """A transformers streamer that marks the first new token (the first put() is the prompt) on a Profiler."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler, self.calls = profiler, 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:
            self.profiler.first_token()

    def end(self) -> None:
        pass


def _count_passes(model: torch.nn.Module, profiler_ref: list[Profiler]) -> Callable[[], None]:
    """Time every forward of `model` on the current profiler: the first is 'prefill', the rest 'target'."""
    state: dict = {}

    def pre(_m, _a):
        prof = profiler_ref[0]
        state["span"] = prof.start("prefill" if "prefill" not in prof.totals() else "target")

    def post(_m, _a, _o):
        state.pop("span").stop()

    h1, h2 = model.register_forward_pre_hook(pre), model.register_forward_hook(post)
    return lambda: (h1.remove(), h2.remove())


def _generation_config(sampling: SamplingParams, max_new: int, eos: list[int], pad: int | None):
    from transformers import GenerationConfig
    kw = dict(max_new_tokens=max_new, min_new_tokens=0, eos_token_id=eos,
              pad_token_id=pad if pad is not None else eos[0], do_sample=not sampling.greedy,
              repetition_penalty=sampling.repetition_penalty)
    if not sampling.greedy:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
                  min_p=sampling.min_p or None)
    return GenerationConfig(**kw)


def _hf_model(path, dtype: torch.dtype, placement: dict):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **_hf_dtype_kw(dtype), **placement)
    return model.eval()


def run_hf(target_path, draft_path, plan: Plan, prompt_ids: list[list[int]], eos: list[int], pad: int | None,
           warmup: int, progress: Callable[[str], None], done: Callable[[Result], None] = lambda r: None
           ) -> list[Result]:
    """hf-offload and hf-assisted on one transformers copy of the target (and of the draft)."""
    from specexec.loading import read_args, resolve_dtype

    kinds = [k for k in ("hf-offload", "hf-assisted") if k in plan.kinds]
    if not kinds:
        return []
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()          # our status line reports progress; transformers' bars would
    hf_logging.set_verbosity_error()           # interleave with it, and its deprecation notes are not ours
    device = plan.config.device
    dtype = resolve_dtype(plan.config.dtype, torch.device(device))
    with tempfile.TemporaryDirectory(prefix="specexec-hf-offload-") as folder:
        progress("loading the transformers target")
        placement = hf_placement(plan.offload, read_args(target_path).n_layers, device, folder)
        target = _hf_model(target_path, dtype, placement)
        draft = None
        if "hf-assisted" in kinds:
            progress("loading the transformers draft")
            draft = _hf_model(draft_path, dtype, {"device_map": {"": device if device != "cuda" else 0}})
        results = []
        for k in kinds:
            results.append(_run_hf_kind(k, target, draft if k == "hf-assisted" else None, plan, prompt_ids, eos,
                                        pad, warmup, progress))
            done(results[-1])
        del target, draft
        gc.collect()
    return results


def _hf_generate(target, draft, ids: list[int], gen_cfg, profiler: Profiler, seed: int | None,
                 device: torch.device) -> list[int]:
    if seed is not None:
        torch.manual_seed(seed)
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg,
                              assistant_model=draft, streamer=_FirstToken(profiler))
    return out[0, len(ids):].tolist()


def _run_hf_kind(kind: str, target, draft, plan: Plan, prompt_ids: list[list[int]], eos: list[int],
                 pad: int | None, warmup: int, progress: Callable[[str], None]) -> Result:
    device = torch.device(plan.config.device)
    gen_cfg = _generation_config(plan.sampling, plan.config.max_new_tokens, eos, pad)
    prof_ref = [Profiler(device)]
    remove = _count_passes(target, prof_ref)
    try:
        if warmup:
            _hf_generate(target, draft, prompt_ids[0][:8], _generation_config(plan.sampling, warmup, eos, pad),
                         prof_ref[0], plan.sampling.seed, device)
        res = Result(kind, note="transformers generate(), unquantized")
        with PeakMemory(device) as mem:
            for j, ids in enumerate(prompt_ids, 1):
                progress(f"{kind} · prompt {j}/{len(prompt_ids)}")
                prof = prof_ref[0] = Profiler(device)
                new = _hf_generate(target, draft, ids, gen_cfg, prof, plan.sampling.seed, device)
                spans = prof.totals()
                prefill_s = spans.get("prefill", {}).get("ms", 0.0) / 1000
                passes = int(sum(t["calls"] for t in spans.values()))
                res.add(new, passes, max(prof.wall_s - prefill_s, 0.0), prof.ttft_s)
        res.peak_ram, res.peak_vram = mem.ram_bytes, mem.vram_bytes
        return res
    finally:
        remove()


# -------------------------------------------------------------------- report

def _gb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first new token where two outputs differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def make_rows(results: list[Result], greedy: bool) -> list[dict]:
    """The JSON rows: one per configuration, with the identical-output check and speed-ups vs each baseline."""
    base = next((r for r in results if r.config == "no-draft"), None)
    baseline_tok_s = {r.config: r.tok_s for r in results if r.config in BASELINES}
    rows = []
    for r in results:
        same = mismatch = None
        if greedy and base is not None:
            same = sum(a == b for a, b in zip(r.outputs, base.outputs))
            mismatch = [first_mismatch(a, b) for a, b in zip(r.outputs, base.outputs)]
        rows.append({
            "config": r.config, "tok_s": _round(r.tok_s, 3),
            "tokens_per_pass": _round(r.new_tokens / r.passes if r.passes else None, 3),
            "ttft_s": _round(sum(r.ttfts) / len(r.ttfts) if r.ttfts else None, 4),
            "identical_to_baseline": None if same is None else same == len(base.outputs),
            "identical_prompts": None if same is None else f"{same}/{len(base.outputs)}",
            "first_mismatch": mismatch,
            "peak_ram_gb": _gb(r.peak_ram), "peak_vram_gb": _gb(r.peak_vram),
            "new_tokens": r.new_tokens, "passes": r.passes, "decode_s": _round(r.decode_s, 4),
            "speedup": {b: _round(r.tok_s / t, 3) if r.tok_s and t else None for b, t in baseline_tok_s.items()},
            "budget": r.budget, "builder": r.builder, "note": r.note or None,
        })
    return rows


def _cell(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def make_table(rows: list[dict], title: str) -> Table:
    baselines = [b for b in BASELINES if any(r["config"] == b for r in rows)]
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("config", "tok/s", "tok/pass", "TTFT s", "peak RAM GB", "peak VRAM GB", "identical (T=0)",
                *[f"× {b}" for b in baselines]):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        ident = "–" if r["identical_prompts"] is None else \
            f"{'yes' if r['identical_to_baseline'] else 'NO'} {r['identical_prompts']}"
        at = sorted(i for i in r["first_mismatch"] or () if i is not None)
        ident += f" (from token {', '.join(map(str, at))})" if at else ""
        t.add_row(r["config"], _cell(r["tok_s"], ".2f"), _cell(r["tokens_per_pass"], ".2f"),
                  _cell(r["ttft_s"], ".3f"), _cell(r["peak_ram_gb"], ".2f"), _cell(r["peak_vram_gb"], ".2f"), ident,
                  *[_cell(r["speedup"].get(b), ".2f") for b in baselines])
    return t


# -------------------------------------------------------------------- entry point

def _done_line(console: Console) -> Callable[[Result], None]:
    """One dim line per finished configuration (long runs show progress in a log file too)."""
    def done(r: Result) -> None:
        rate = f"{r.tok_s:.2f} tok/s" if r.tok_s else "– tok/s"
        console.print(f"done {r.config}: {r.new_tokens} tokens · {rate} · {r.passes} target passes", style="dim",
                      highlight=False, markup=False)
    return done


def _wide(console: Console) -> Console:
    """Not a terminal (a file, a pipe): wide enough that the table never wraps."""
    if not console.is_terminal:
        console.width = max(console.width, 160)
    return console


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    common.apply_catalog_defaults(args, console)
    plan = make_plan(args)
    runtime = common.load_runtime(args, plan.config, console, plan.offload)
    from cli.generate import print_load_summary

    print_load_summary(console, runtime)
    warn = lambda msg: console.print(f"warning: {msg}", style="yellow", highlight=False, markup=False)  # noqa: E731
    prompt_ids = encode_prompts(runtime, plan.prompts, plan.config.max_new_tokens, args.raw, warn)
    eos, pad = sorted(runtime.engine.eos_ids), runtime.tokenizer.pad_token_id
    paths = (runtime.target_info.path, runtime.draft_info.path if runtime.draft_info else None)
    with console.status("benchmarking") as status:
        say = lambda msg: status.update(msg)  # noqa: E731
        results = run_ours(runtime, plan, prompt_ids, args.warmup, say, _done_line(console))
        release(runtime)
        del runtime
        gc.collect()
        results += run_hf(*paths, plan, prompt_ids, eos, pad, args.warmup, say, _done_line(console))
    rows = make_rows(results, plan.sampling.greedy)
    title = (f"{len(prompt_ids)} prompts · up to {plan.config.max_new_tokens} new tokens · temperature "
             f"{plan.sampling.temperature} · {plan.config.device}")
    if args.json:
        _wide(console).print(make_table(rows, title))
        print(json.dumps({"rows": rows, "prompts": len(prompt_ids), "max_new_tokens": plan.config.max_new_tokens,
                          "temperature": plan.sampling.temperature, "device": plan.config.device,
                          "dtype": plan.config.dtype, "model": str(paths[0]),
                          "draft": str(paths[1]) if paths[1] else None}, separators=(",", ":")), flush=True)
    else:
        _wide(Console(soft_wrap=True)).print(make_table(rows, title))
    return 0
