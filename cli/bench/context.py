"""`specexec bench --context 1k,8k,32k`: the cost of context as one table.

For each context, every prompt of the set is asked after the same long document (the built-in handbook,
specexec/prompts/document.py, cut so that document + question + the answer fill the context): a shared
prefix, as when a user pastes a file and asks several questions about it. Each configuration (specexec at
each budget, the target alone, and with --kv-quant int8 the same again with an int8 KV cache) starts from an
empty cache per context; its first prompt prefills the whole document, the next ones reuse it and prefill
only their question.

Per row (context, configuration): tok_s = new tokens / decode seconds over the prompts; tokens_per_pass;
prefill_s = the first prompt's prefill (the document); prefill_tok_s; pass_s = mean target seconds per step
(one streamed pass of the target, with its acceptance); identical (T = 0) = token ids equal to the target
alone at the same context with an exact cache. int8 rows are LOSSY: they are never called identical; the
column gives the first token where each prompt's output diverges (or "same").

Does not know: how a step works (specexec.decoding.engine), how prompts are encoded (Runtime.encode).
"""
from __future__ import annotations

import gc
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.table import Table

from cli.bench.common import Plan, first_mismatch
from cli.bench.table import cell
from specexec.config import SamplingParams
from specexec.options import ConfigError, budget_options
from specexec.prompts import Prompt
from specexec.prompts.document import long_document
from specexec.runtime.assembly import Runtime

QUESTION_ROOM = 160          # tokens kept free for the question and the chat template around the document
_SIZE = re.compile(r"^(\d+)(k?)$", re.IGNORECASE)


def parse_contexts(text: str) -> tuple[int, ...]:
    """'1k,8k,32k' -> (1024, 8192, 32768); plain token counts too. ConfigError for anything else."""
    out = []
    for item in (t.strip() for t in str(text).split(",")):
        m = _SIZE.match(item)
        if not m:
            raise ConfigError(f"--context: {item!r} is not a context size; write them like 1k,8k,32k or 4096")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 256:
            raise ConfigError(f"--context: {item} is too short for a document and a question (at least 256)")
        out.append(n)
    return tuple(dict.fromkeys(out))


def context_prompts(runtime: Runtime, prompts: tuple[Prompt, ...], context: int, max_new: int,
                    raw: bool) -> list[list[int]]:
    """Each prompt after the document cut to fill `context` (minus the answer and QUESTION_ROOM)."""
    if context > runtime.context:
        raise ConfigError(f"--context {context} exceeds the model's context of {runtime.context} tokens")
    room = context - max_new - QUESTION_ROOM
    if room < 64:
        raise ConfigError(f"--context {context} leaves no room for the document with --max-new-tokens {max_new}")
    doc_ids = runtime.tokenizer.encode(long_document(), add_special_tokens=False)
    if len(doc_ids) < room:
        raise ConfigError(f"--context {context}: the built-in document has only {len(doc_ids)} tokens")
    doc = runtime.tokenizer.decode(doc_ids[:room])
    chat = not raw and bool(getattr(runtime.tokenizer, "chat_template", None))
    out = []
    for p in prompts:
        text = f"Here is a document for reference.\n\n{doc}\n\nNow, unrelated to it: {p.prompt}"
        ids = runtime.encode(text, chat=chat, system=p.system if chat else None)
        out.append(ids[-(context - max_new):])
    return out


@dataclass
class ContextResult:
    context: int
    config: str
    lossy: bool = False
    outputs: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    steps: int = 0
    decode_s: float = 0.0
    target_s: float = 0.0
    prefill_s: float | None = None
    prefill_tokens: int = 0


def run_context(rt: Runtime, name: str, context: int, prompt_ids: list[list[int]], max_new: int,
                sampling: SamplingParams, lossy: bool = False) -> ContextResult:
    """Every prompt through `rt` from an empty cache, the shared document reused after the first."""
    res = ContextResult(context, name, lossy)
    rt.engine.reset()
    for ids in prompt_ids:
        out = [t for step in rt.generate_ids(ids, max_new, sampling) for t in step]
        s = rt.engine.profiler.summary()
        res.outputs.append(out)
        res.new_tokens += len(out)
        res.steps += s["steps"]
        res.decode_s += s["decode_s"] or 0.0
        res.target_s += sum(x.target_ms for x in rt.engine.profiler.steps) / 1000
        if res.prefill_s is None:
            res.prefill_s, res.prefill_tokens = s["prefill_s"], s["prompt_tokens"]
    return res


def variants(plan: Plan) -> list[tuple[str, dict, bool, bool]]:
    """(name, engine config changes, with the draft, lossy): specexec at each budget and the target alone;
    with --kv-quant int8 each again with an int8 cache (the runtime itself is planned for the exact cache)."""
    out = []
    for q in ["none"] + (["int8"] if plan.config.kv_quant == "int8" else []):
        tag = "" if q == "none" else " kv=int8 LOSSY"
        if "specexec" in plan.kinds:
            out += [(f"specexec budget={b}{tag}", {"kv_quant": q, "auto_budget": False,
                                                     **budget_options(b, plan.max_budget)}, True, q != "none")
                    for b in plan.budgets]
        if "no-draft" in plan.kinds:
            out.append((f"no-draft{tag}", {"kv_quant": q}, False, q != "none"))
    return out


def run_contexts(runtime: Runtime, plan: Plan, contexts: tuple[int, ...], raw: bool,
                 progress: Callable[[str], None]) -> list[ContextResult]:
    """Every context, every variant; a variant's engine (and its KV caches) is dropped before the next."""
    results = []
    for c in contexts:
        ids = context_prompts(runtime, plan.prompts, c, plan.config.max_new_tokens, raw)
        for name, changes, with_draft, lossy in variants(plan):
            progress(f"context {c} · {name}")
            rt = runtime.variant(plan.config.replace(**changes), use_draft=with_draft)
            results.append(run_context(rt, name, c, ids, plan.config.max_new_tokens, plan.sampling, lossy))
            del rt
            gc.collect()
    return results


def context_rows(results: list[ContextResult], greedy: bool) -> list[dict]:
    base = {r.context: r for r in results if r.config == "no-draft"}
    rows = []
    for r in results:
        ref = base.get(r.context)
        mismatch = [first_mismatch(a, b) for a, b in zip(r.outputs, ref.outputs)] if greedy and ref else None
        same = None if mismatch is None or r.lossy else all(m is None for m in mismatch)
        rows.append({"context": r.context, "config": r.config, "lossy": r.lossy,
                     "tok_s": round(r.new_tokens / r.decode_s, 3) if r.decode_s else None,
                     "tokens_per_pass": round(r.new_tokens / r.steps, 3) if r.steps else None,
                     "prefill_s": r.prefill_s, "prefill_tokens": r.prefill_tokens,
                     "prefill_tok_s": round(r.prefill_tokens / r.prefill_s, 1) if r.prefill_s else None,
                     "pass_s": round(r.target_s / r.steps, 4) if r.steps else None,
                     "identical_to_baseline": same, "first_mismatch": mismatch,
                     "new_tokens": r.new_tokens, "passes": r.steps})
    return rows


def context_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("context", "config", "tok/s", "tok/pass", "prefill s", "prefill tok/s", "pass s", "identical (T=0)"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        t.add_row(str(r["context"]), r["config"], cell(r["tok_s"], ".2f"), cell(r["tokens_per_pass"], ".2f"),
                  cell(r["prefill_s"], ".2f"), cell(r["prefill_tok_s"], ".0f"), cell(r["pass_s"], ".3f"),
                  _same(r))
    return t


def _same(r: dict) -> str:
    if r["first_mismatch"] is None:
        return "–"
    at = [m for m in r["first_mismatch"] if m is not None]
    if r["lossy"]:
        return "LOSSY: " + (f"diverges at token {', '.join(map(str, at))}" if at else "same tokens here")
    return "yes" if r["identical_to_baseline"] else f"NO (from token {', '.join(map(str, sorted(at)))})"
