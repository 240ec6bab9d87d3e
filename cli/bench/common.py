"""What the prompt-set benchmarks share (`specexec bench`, `bench builders`, `bench accept`): the run plan, one
configuration's result, prompt encoding, and running one runtime variant over every prompt.

Does not know: which configurations a benchmark compares or how it reports them (cli/bench/main.py,
cli/bench/builders.py), how a step works (specexec.decoding.engine).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from cli.bench.progress import tell
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.options import ConfigError
from specexec.profiler import PeakMemory
from specexec.prompts import Prompt
from specexec.runtime.assembly import Runtime

WARMUP_PROMPT = "Hello"


@dataclass(frozen=True)
class Plan:
    """Everything a benchmark will do, checked before any model loads."""

    config: EngineConfig
    sampling: SamplingParams
    offload: OffloadConfig
    budgets: tuple[int | str, ...]
    max_budget: int | None
    kinds: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    repeat: int = 1
    contexts: tuple[int, ...] = ()        # bench --context: the sweep (cli/bench/context.py); () = the plain bench
    drafts: tuple[str, ...] = ()          # the drafts compared (paths, names, self[:FMT]); () with --no-draft


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
    draft_s: float = 0.0          # summed over steps (our runtime only)
    target_s: float = 0.0
    budgets: list[int] = field(default_factory=list)      # the tree budget each step asked for (--budget auto)
    lossy: bool = False           # ran with an int8 KV cache (--kv-quant int8): never in an exactness claim
    draft: str | None = None      # the draft of a specexec row (a path, a name or self[:FMT])
    moe_runs: list[dict] = field(default_factory=list)    # stats.moe of each prompt (an MoE target)
    gate_runs: list[dict | None] = field(default_factory=list)   # stats.gate of each prompt (a gated row)
    accept: str = "exact"         # --accept's label (relaxed: LOSSY, never called identical)
    relaxed_tokens: int = 0       # relaxed: emitted tokens exact acceptance would not have chosen, over prompts

    def gate(self) -> dict | None:
        """stats.gate summed over the prompts, its events prefixed with their prompt (None: not gated)."""
        runs = [(i, g) for i, g in enumerate(self.gate_runs, 1) if g]
        if not runs:
            return None
        total = {k: sum(g[k] for _, g in runs) for k in ("switches", "plain_steps", "speculative_steps")}
        return {**total, "events": [f"prompt {i}: {e}" for i, g in runs for e in g["events"]]}

    def moe(self) -> dict | None:
        """stats.moe over every prompt (means over all passes, weighted by each prompt's passes)."""
        runs = [m for m in self.moe_runs if m]
        n = sum(m["passes"] for m in runs)
        if not n:
            return None
        keys = ("distinct_experts_per_layer", "expert_bytes_per_pass", "draft_expert_bytes_per_pass",
                "cpu_expert_rows_per_pass", "cpu_expert_bytes_crossed_per_pass")
        mean = {k: round(sum(m.get(k, 0.0) * m["passes"] for m in runs) / n, 3)
                for k in keys if any(k in m for m in runs)}
        rates = [(m["expert_cache_hit_rate"], m["passes"]) for m in runs if m["expert_cache_hit_rate"] is not None]
        hit = round(sum(r * p for r, p in rates) / sum(p for _, p in rates), 4) if rates else None
        return {**mean, "expert_bytes_all": runs[0]["expert_bytes_all"], "expert_cache_hit_rate": hit, "passes": n}

    def add(self, ids: list[int], passes: int, decode_s: float, ttft_s: float | None, draft_s: float = 0.0,
            target_s: float = 0.0) -> None:
        self.outputs.append(list(ids))
        self.new_tokens += len(ids)
        self.passes += passes
        self.decode_s += decode_s
        self.draft_s += draft_s
        self.target_s += target_s
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


def config_name(kind: str, budget: int | str | None = None, builder: str = "specexec", label: str = "specexec"
                ) -> str:
    """A row's name: `LABEL budget=N [builder=B]` for a specexec row (label: the draft's, bench.draft_label)."""
    if kind != "specexec":
        return kind
    return f"{label} budget={budget}" + (f" builder={builder}" if builder != "specexec" else "")


def run_variant(name: str, rt: Runtime, budget: int | str | None, plan: Plan, prompt_ids: list[list[int]],
                 warmup: int, progress: Callable[[str], None], sampling: SamplingParams | None = None) -> Result:
    """Every prompt through `rt` (KV cache reset before each) at `sampling` (default the plan's). The untimed
    warm-up warms kernels and caches; a --budget auto tuner keeps the seconds it measured there but forgets its
    acceptance, which says nothing of the prompts (it would start the row at the budget a 4-token "Hello" chose)."""
    max_new, sampling = plan.config.max_new_tokens, sampling or plan.sampling
    if warmup:
        rt.engine.reset()
        for _ in rt.generate_ids(rt.encode(WARMUP_PROMPT), warmup, sampling):
            pass
        if rt.engine.tuner is not None:
            rt.engine.tuner.forget_acceptance()
    res = Result(name, budget=budget, builder=rt.builder_name if budget is not None else None,
                 accept=rt.config.accept.label)
    with PeakMemory(rt.engine.device) as mem:
        for j, ids in enumerate(prompt_ids):
            tell(progress, name, j, len(prompt_ids))
            rt.engine.reset()
            out = [t for step in rt.generate_ids(ids, max_new, sampling) for t in step]
            steps = rt.engine.profiler.steps
            s = rt.engine.profiler.summary()
            res.add(out, s["steps"], s["decode_s"] or 0.0, s["ttft_s"], sum(x.draft_ms for x in steps) / 1000,
                    sum(x.target_ms for x in steps) / 1000)
            res.budgets += [x.budget for x in steps if x.budget is not None]
            res.moe_runs.append(s["moe"])
            res.gate_runs.append(s["gate"])
            res.relaxed_tokens += rt.engine.stats.relaxed_tokens
        tell(progress, name, len(prompt_ids), len(prompt_ids))
    res.peak_ram, res.peak_vram = mem.ram_bytes, mem.vram_bytes
    return res


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first new token where two outputs differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def wide(console: Console) -> Console:
    """Not a terminal (a file, a pipe): wide enough that the table never wraps."""
    if not console.is_terminal:
        console.width = max(console.width, 160)
    return console


