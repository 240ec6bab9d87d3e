"""`specexec generate`: decode one prompt with a target (+ draft) and stream the continuation to stdout.

Contract (scripts and benchmarks rely on it): plain mode writes the continuation to stdout as it is produced,
flushed per step, and everything else (load summary, stats, warnings) to stderr. `--json` writes ONE compact
JSON line to stdout: {"text", "token_ids" (generated ids only, EOS kept, at most --max-new-tokens), "stats":
{steps, tokens_per_step, prefill_tok_s, decode_tok_s, draft_ms, target_ms, tree_size, budget, builder, accept}};
with --accept relaxed (LOSSY) also delta, k and relaxed_tokens (emitted tokens exact acceptance would not have
chosen at their node), and the stats line says so.

Does not know: how models load or how a step works (specexec.runtime.assembly), what values are valid
(specexec.options checks every one of them).
"""
from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from cli import threads
from cli.args import (add_engine_args, add_model_args, add_offload_args, add_sampling_args, apply_catalog_defaults,
                      check_target, engine_config, offload_config, print_plan, sampling_params)
from offload.formats.bounded_read import MAX_BYTES, read_bytes, read_stream, too_large
from specexec.config import EngineConfig, SamplingParams
from cli.prefill_bar import prefill_bar
from specexec.builders.registry import builder_needs_draft
from specexec.options import (
    ConfigError, check_chat_options, check_draft_choice, check_number, check_prompt_text, help_list,
    parse_draft_vocab)
from cli.help import LazyHelp

if TYPE_CHECKING:                                  # annotations only: the command line parses without torch
    from specexec.runtime.assembly import Runtime
    from specexec.runtime.loaders import ModelInfo


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="decode one prompt and stream the continuation",
                       description="Decode one prompt with the target model, drafting with --draft.")
    add_model_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (UTF-8); - reads stdin")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    add_sampling_args(p)
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="N independent samples of the same prompt (loaded and prefilled once)")
    p.add_argument("--verifier", metavar="RULE",
                   help=LazyHelp(lambda: f"acceptance rule at T > 0: {help_list(_verifier_names())} (default auto: the "
                                 "builder's own)"))
    add_engine_args(p)
    p.add_argument("--draft-vocab", metavar="N|auto",
                   help="VocabTrim: the draft proposes only the N tokens the target samples most (measured once "
                        "on the built-in prompts, cached); auto picks N; output is unchanged")
    p.add_argument("--stop", nargs="+", default=[], metavar="STR", help="end before the first of these strings")
    p.add_argument("--json", action="store_true", help="print one JSON line (text, token_ids, stats) to stdout")
    add_offload_args(p)
    return p


def _verifier_names() -> tuple[str, ...]:
    from specexec.acceptance.rules import verifier_names   # imports torch: read when --help-all shows it

    return verifier_names()


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, SamplingParams]:
    """Every value checked (by specexec.options) before anything is loaded."""
    config = engine_config(args, auto_budget=True, **({"verifier": args.verifier} if args.verifier is not None else {}),
                           draft_vocab=parse_draft_vocab(args.draft_vocab))
    sampling = sampling_params(args)
    check_number("--n", args.n, low=1, high=10_000)
    needs = builder_needs_draft(config.builder)          # an unknown --builder is said before the path
    check_target(args)
    check_draft_choice(args.draft, args.no_draft, config.builder, needs)
    check_chat_options(args.chat, args.system)
    if args.system is not None:
        check_prompt_text(args.system, "--system", allow_empty=True)
    return config, sampling


def read_stdin(what: str = "stdin") -> str:
    """All of stdin as UTF-8 text, decoded here from its bytes (whatever the locale's errors handler), so bytes
    that are not UTF-8 end in one ConfigError instead of a UnicodeDecodeError or lone surrogates."""
    stream = sys.stdin
    if stream is None:
        raise ConfigError(f"{what}: there is no standard input")
    if hasattr(stream, "buffer"):
        data = read_stream(stream.buffer, what, ConfigError)         # `yes | ...` ends in one line, not all memory
    else:
        text = stream.read(MAX_BYTES + 1)
        if len(text) > MAX_BYTES:
            raise ConfigError(too_large(what, MAX_BYTES))
        data = text.encode("utf-8", "surrogateescape")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text (--prompt, --prompt-file FILE or - for stdin), checked by options.check_prompt_text."""
    if args.prompt is not None:
        check_prompt_text(args.prompt, "--prompt")
        return args.prompt
    if args.prompt_file == "-":
        text = read_stdin("the prompt on stdin (--prompt-file -)")
        check_prompt_text(text, "the prompt on stdin (--prompt-file -)")
        return text
    text = _read_prompt_file(args.prompt_file)
    check_prompt_text(text, f"--prompt-file {args.prompt_file}")
    return text


def _read_prompt_file(name: str) -> str:
    try:
        return read_bytes(name, f"--prompt-file {name}", ConfigError).decode("utf-8")
    except ConfigError:
        raise
    except UnicodeDecodeError:
        raise ConfigError(f"--prompt-file {name} is not UTF-8 text") from None
    except (OSError, ValueError) as e:            # ValueError: a NUL byte in the path
        raise ConfigError(f"cannot read --prompt-file {name}: {getattr(e, 'strerror', None) or e}") from None


def _human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


def print_load_summary(console: Console, runtime: Runtime, sweep: str | None = None) -> None:
    """The loaded models, one line each, then the builder and budget (`sweep`: what a benchmark sweeps instead,
    e.g. "sweeping 40 prompts over budgets 8, 32, no-draft")."""
    def line(role: str, info: ModelInfo, tail: str = "") -> None:
        console.print(f"[bold]{role}[/] {info.path} · {info.args.family} · {info.args.n_layers} layers · "
                      f"{_human(info.params)} params · {info.dtype} · {info.device} · loaded in {info.load_s:.2f} s"
                      + escape(tail), markup=True, highlight=False)

    line("target", runtime.target_info, threads.note(str(runtime.target_info.device).split(":")[0]))
    if runtime.draft_info is not None:
        line("draft ", runtime.draft_info)
        if runtime.pair_note:
            console.print(runtime.pair_note, highlight=False)
        if runtime.depth is not None:              # --draft-layers auto: the depth the probe chose
            console.print(runtime.depth.line(), highlight=False)
    if runtime.engine.builder is None:
        console.print("no draft: decoding with the target alone" + (f" · {sweep}" if sweep else ""), highlight=False)
    else:
        c = runtime.config
        budget = f"auto (up to {c.budget} tokens)" if c.auto_budget else f"{c.budget} tokens"
        console.print(f"builder {runtime.builder_name} · " + (sweep or f"budget {budget}"), highlight=False)
    if runtime.config.accept.relaxed:
        console.print(f"acceptance {runtime.config.accept.label}: LOSSY, drafted tokens near the target's choice "
                      "pass too; the output may differ from the target's own", style="yellow", highlight=False)
    if runtime.config.kv_quant != "none":
        console.print(f"KV cache {runtime.config.kv_quant}: LOSSY, the output may differ from the target's own "
                      "(no exactness claim holds)", style="yellow", highlight=False)


def shown(text: str) -> str:
    """Model text as a terminal shows it: control characters other than newline and tab (ESC, CR, BEL, the C1
    controls, ...) escaped (\\x1b), so a model's output can never move the cursor, recolour or clear the screen."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else c.encode("unicode_escape").decode()
                   for c in text)


def write_text(text: str) -> None:
    """Write model text to stdout, flushed; to a terminal with control characters escaped (shown); characters
    the terminal cannot encode become '?'."""
    if sys.stdout.isatty():
        text = shown(text)
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        enc = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(enc, errors="replace").decode(enc))
    sys.stdout.flush()


def stream(runtime: Runtime, prompt_ids: list[int], sampling: SamplingParams, stop: list[str],
           echo: bool, console: Console | None = None) -> tuple[list[int], str]:
    """Run generation; with echo, write the new text after each step (a long prefill shows a progress bar on
    `console` first). Returns (ids, text)."""
    ids: list[int] = []
    text = ""
    with prefill_bar(console or Console(stderr=True, quiet=True), runtime.engine) as bar:
        for new, piece in runtime.generate_text(prompt_ids, runtime.config.max_new_tokens, sampling, stop):
            bar.stop()
            ids += new
            text += piece
            if echo and piece:
                write_text(piece)
    if echo:
        write_text("\n")
    return ids, text


def _stats_line(stats: dict, n_tokens: int) -> str:
    rate = f"{stats['decode_tok_s']} tok/s" if stats["decode_tok_s"] else "n/a"
    return (f"{n_tokens} tokens in {stats['steps']} steps ({stats['tokens_per_step']} tokens/step) · decode "
            f"{rate} · prefill {stats['prefill_tok_s']} tok/s · per step: draft {stats['draft_ms']} ms, "
            f"target {stats['target_ms']} ms, tree {stats['tree_size']} · builder {stats['builder']}"
            + (f" · budget per step {stats['budget_trace']}" if stats.get("budget") == "auto" and
               stats.get("budget_trace") else "") + relaxed_note(stats))


def relaxed_note(stats: dict) -> str:
    """' · accept relaxed ...' for a relaxed run's stats line (LOSSY, never silent); '' for an exact one."""
    if stats.get("accept") != "relaxed":
        return ""
    return (f" · accept relaxed (LOSSY) delta {stats['delta']:g} k {stats['k']}: {stats['relaxed_tokens']} tokens "
            "differ from exact acceptance")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    apply_catalog_defaults(args, console)
    offload = offload_config(args)
    config, sampling = _configs(args)
    prompt = read_prompt(args)
    from specexec.runtime.assembly import Runtime

    with console.status("loading") as status:          # a transient spinner: only the ledger is left on stderr
        runtime = Runtime.load(args.model, args.draft, config, args.allow_pickle,
                               progress=lambda msg: status.update(msg), offload=offload,
                               on_plan=print_plan(console))
    prompt_ids = runtime.encode(prompt, args.chat, args.system)
    runtime.check_prompt(prompt_ids)
    print_load_summary(console, runtime)
    results = []
    try:
        for i in range(args.n):
            if args.n > 1 and not args.json:
                console.print(f"--- sample {i + 1}/{args.n}", highlight=False, style="bold")
            seeded = sampling if sampling.seed is None or i == 0 else replace(sampling, seed=sampling.seed + i)
            ids, text = stream(runtime, prompt_ids, seeded, list(args.stop), echo=not args.json, console=console)
            stats = runtime.stats()
            results.append({"text": text, "token_ids": ids, "stats": stats})
            if not args.json:
                console.print(_stats_line(stats, len(ids)), highlight=False, style="dim")
                for line in stats.get("gate", {}).get("events", ()):          # --gate: when and why it switched
                    console.print(line, highlight=False, style="dim", markup=False)
    finally:
        runtime.engine.close()          # an offloaded target's pager thread (in-process callers: tests, scripts)
    if args.json:
        out = results[0] if args.n == 1 else results
        print(json.dumps(out, separators=(",", ":")), flush=True)
    return 0
