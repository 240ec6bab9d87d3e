"""`specexec chat`: a terminal chat with a target (+ draft), streaming each answer as tokens are accepted.

Every turn renders the WHOLE conversation through the model's own chat template and hands all of its ids to
the engine, which keeps the KV cache of the longest common token prefix with the previous call and prefills
only the rest (so a template that rewrites old turns costs only what changed; a model with recurrent layers
returns only to the end of its last prompt or keeps everything: KVCache.reusable). When the conversation no
longer fits the context, the oldest turns are dropped with a notice (and, for recurrent layers, that the rest is
read again). Ctrl-C stops the current answer (what
was shown stays in the history) and keeps the session; Ctrl-D or /exit leaves. When stdin is not a terminal,
the whole of stdin is one user turn and only the answer is printed (for scripts).

With no --draft, no --no-draft and no draft recommended by models.yaml, the target drafts for itself (--draft
self: its own layers, shown in the plan) rather than refusing.

Answer text goes to stdout; everything else (progress, notices, stats) goes to stderr through rich.

Failures inside a turn: out of memory in a step (CUDA OOM or MemoryError) is reported in one line with the knobs
to turn and the session goes on; the failed turn leaves nothing in the history (the engine's KV cache keeps only
a prefix of what it was given, so the next turn reuses what is valid and prefills the rest). A layer cache that
breaks under a running session (layers.bin truncated or overwritten) ends it with one line (exit 2): every later
pass would fail the same way, and the next start rebuilds the cache. A cache directory deleted under a running
session does not matter: the open file keeps serving it. The offloaded target's pager thread is stopped when
the session ends, however it ends.

Does not know: how a step works or how models load (specexec.runtime.assembly), what a setting may be
(specexec.config.with_field validates /set values), how a message is read from the terminal
(cli/terminal_input.py; line editing: input() and readline).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from cli import args as common
from cli.generate import read_stdin, relaxed_note, write_text
from cli.prefill_bar import PrefillBar
from cli.terminal_input import input_held, read_message
from offload.formats.json_files import read_json
from specexec.config import SamplingParams, with_field
from specexec.options import ConfigError, budget_options, check_prompt_text

if TYPE_CHECKING:                                  # annotations only: the command line parses without torch
    from specexec.runtime.assembly import Runtime

DEFAULT_MAX_NEW = 1024          # per answer, capped at half the context
SAVE_FORMAT = "specexec-chat"
ENGINE_SETTINGS = ("max_new_tokens", "budget")

HELP = """\
Type a message and press Enter. Multi-line: end a line with \\ to continue on the next one, or put \"\"\" on a
line of its own to start and to end a block (for pastes). Start a message with // to send a leading /.
  /help                 this text
  /reset                forget the conversation (keeps the system message and settings)
  /system [TEXT|-]      show, set, or (with -) clear the system message
  /set [NAME VALUE]     show settings, or change one: temperature, top_p, top_k, min_p, repetition_penalty,
                        presence_penalty, frequency_penalty, seed (none = random), max_new_tokens, budget (N or
                        auto), e.g. /set temperature 0.7
  /stats                the last answer's profile (per phase: draft, target, prefill, streaming)
  /save FILE            write the conversation as JSON
  /load FILE            read a conversation written by /save (replaces the current one)
  /retry                drop the last answer and answer the last message again
  /exit                 leave (Ctrl-D too); Ctrl-C stops an answer and keeps the session"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="chat with a model in the terminal (streaming, history, /commands)",
                       description="Chat with the target model, drafting with --draft. Reads one message from "
                                   "stdin and prints only the answer when stdin is not a terminal.")
    common.add_common_args(p, max_new_default=f"{DEFAULT_MAX_NEW}, at most half the context")
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--profile", action="store_true", help="print the per-phase profile after each answer")
    common.add_flag(p, "--prompt-cache")
    return p


@dataclass
class Answer:
    """One answer: its ids, the text the user saw, whether Ctrl-C cut it, and the engine's profile."""

    ids: list[int]
    text: str
    interrupted: bool
    profile: dict = field(default_factory=dict)


class ChatSession:
    """The conversation, the settings and the runtime. Terminal I/O only through `write` (answer text) and
    `console` (everything else), so tests can drive it in-process."""

    def __init__(self, runtime: Runtime, sampling: SamplingParams, system: str | None, console: Console,
                 write: Callable[[str], None], max_new_tokens: int | None = None, profile: bool = False) -> None:
        self.runtime, self.sampling, self.system = runtime, sampling, system
        self.console, self.write, self.profile = console, write, profile
        self.max_new_tokens = max_new_tokens or min(DEFAULT_MAX_NEW, max(runtime.context // 2, 1))
        self.messages: list[dict[str, str]] = []       # user/assistant turns, oldest first
        self.last: Answer | None = None

    # ---------------------------------------------------------------- conversation
    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        from specexec.runtime.tokenizer import encode_messages

        return encode_messages(self.runtime.tokenizer, head + messages)

    def fit(self, user: str) -> list[int]:
        """Prompt ids of the conversation plus `user`; drops the oldest turns while it does not fit."""
        pending = self.messages + [{"role": "user", "content": user}]
        dropped = 0
        while True:
            ids = self._render(pending)
            if len(ids) + self.max_new_tokens <= self.runtime.context:
                break
            if len(pending) <= 1:
                what = "this message and the system message are" if self.system else "this message is"
                shorten = "shorten them (/system TEXT replaces it, /system - clears it)" if self.system \
                    else "shorten it"
                raise ConfigError(f"{what} {len(ids)} tokens with the template; with max_new_tokens "
                                  f"{self.max_new_tokens} it exceeds the context of {self.runtime.context} tokens; "
                                  f"{shorten} or lower max_new_tokens (/set max_new_tokens N)")
            pending = pending[2:]                     # one user + assistant pair, the oldest
            dropped += 1
        if dropped:
            self.messages = pending[:-1]
            self.console.print(f"dropped the {dropped} oldest turn(s): the conversation outgrew the context of "
                               f"{self.runtime.context} tokens", style="yellow", highlight=False)
            if self.runtime.engine.recurrent:
                self.console.print("this model's recurrent state cannot forget turns: the rest of the conversation "
                                   "is read again from its start", style="yellow", highlight=False)
        return ids

    def ask(self, user: str) -> Answer:
        """Answer `user` (streamed through write); the turn and the answer as shown join the history."""
        prompt_ids = self.fit(user)
        answer = self._stream(prompt_ids)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.text}]
        self.last = answer
        self._report(answer)
        return answer

    def _stream(self, prompt_ids: list[int]) -> Answer:
        from specexec.runtime.detokenizer import Detokenizer

        detok = Detokenizer(self.runtime.tokenizer, prompt_ids)
        ids: list[int] = []
        shown, interrupted = "", False
        steps = self.runtime.generate_ids(prompt_ids, self.max_new_tokens, self.sampling)
        bar = PrefillBar(self.console)                 # long prefills: a progress bar until the first tokens
        self.runtime.engine.on_prefill = bar
        try:
            for new in steps:
                bar.stop()
                ids += new
                text = detok.stable_text(ids)
                if len(text) > len(shown):
                    piece, shown = text[len(shown):], text      # counted as shown even if Ctrl-C cuts the write
                    self.write(piece)
            rest = detok.text(ids)[len(shown):]
            shown += rest
            self.write(rest + "\n")
        except KeyboardInterrupt:
            interrupted = True
            self.write("\n")
        finally:
            bar.stop()
            self.runtime.engine.on_prefill = None
            steps.close()
        engine = self.runtime.engine
        return Answer(ids, shown, interrupted, {**engine.profiler.summary(), **engine.stats.acceptance()})

    def _report(self, answer: Answer) -> None:
        if answer.interrupted:
            self.console.print("[interrupted: the answer so far stays in the history]", style="yellow",
                               highlight=False, markup=False)
        for line in (answer.profile.get("gate") or {}).get("events", ()):   # --gate: when and why it switched
            self.console.print(line, style="dim", highlight=False, markup=False)
        self.console.print(stats_line(answer.profile), style="dim", highlight=False)
        if self.profile:
            from specexec.profiler import summary_table
            self.console.print(summary_table(answer.profile, "profile of this answer"))

    # ---------------------------------------------------------------- commands
    def handle(self, line: str) -> bool:
        """One input: a /command or a message. False when the session should end. User mistakes (bad
        settings, unreadable files, a message too long) are reported in one line and the session goes on."""
        try:
            return self._handle(line)
        except ConfigError as e:
            self.console.print(f"error: {' '.join(str(e).split())}", style="red", highlight=False, markup=False)
        except OSError as e:
            self.console.print(f"error: {e.filename or ''}: {e.strerror or e}", style="red", highlight=False,
                               markup=False)
        except (RuntimeError, MemoryError) as e:
            if not _out_of_memory(e):
                raise
            _free_cuda_cache()
            self.console.print("error: out of memory during a step; lower the tree budget (/set budget N) or "
                               "offload more (--gpu-budget / --ram-budget)", style="red", highlight=False,
                               markup=False)
        return True

    def _handle(self, line: str) -> bool:
        text = line.strip()
        if not text:
            return True
        check_prompt_text(line, "this message", allow_empty=True)    # a stray byte: one line, the session stays
        if text.startswith("//"):
            self.ask(line.lstrip()[1:])
            return True
        if not text.startswith("/"):
            self.ask(line)
            return True
        name, _, rest = text[1:].partition(" ")
        command = COMMANDS.get(name.lower())
        if command is None:
            raise ConfigError(f"unknown command /{name}; /help lists the commands (// sends a leading /)")
        return command(self, rest.strip()) is not False

    def cmd_help(self, _rest: str) -> None:
        self.console.print(HELP, highlight=False, markup=False)

    def cmd_exit(self, _rest: str) -> bool:
        return False

    def cmd_reset(self, _rest: str) -> None:
        self.messages, self.last = [], None
        self.runtime.engine.reset()
        self.console.print("conversation cleared", style="dim")

    def cmd_system(self, rest: str) -> None:
        if not rest:
            self.console.print(f"system message: {self.system!r}" if self.system else "no system message",
                               highlight=False, markup=False)
            return
        check_prompt_text(rest, "the system message")
        self.system = None if rest == "-" else rest
        self.console.print("system message cleared" if self.system is None else "system message set",
                           style="dim")

    def cmd_set(self, rest: str) -> None:
        name, _, value = rest.partition(" ")
        if not name:
            self.console.print(self.settings_line(), highlight=False, markup=False)
            return
        if not value.strip():
            raise ConfigError(f"/set {name} needs a value, e.g. /set temperature 0.7")
        key = name.replace("-", "_")
        sampling = [f.name for f in fields(self.sampling)]
        if key not in ENGINE_SETTINGS and key not in sampling:      # every name /set takes, not the sampling's alone
            raise ConfigError(f"unknown setting {name!r}; settable: {', '.join(sampling + list(ENGINE_SETTINGS))}")
        if key in ENGINE_SETTINGS:
            self._set_engine(key, value)
        else:
            self.sampling = with_field(self.sampling, key, value)
        self.console.print(self.settings_line(), style="dim", highlight=False, markup=False)

    def _set_engine(self, key: str, value: str) -> None:
        if key == "max_new_tokens":
            self.max_new_tokens = with_field(self.runtime.config, key, value).max_new_tokens
            return
        config = self.runtime.config.replace(**{"auto_budget": False, **budget_options(value.strip())})
        if self.runtime.engine.builder is None:
            raise ConfigError("there is no draft model, so there is no tree budget to set")
        self.runtime = self.runtime.variant(config)   # same models, new engine: the next turn prefills again

    def settings_line(self) -> str:
        s = self.sampling
        c = self.runtime.config
        budget = (f"auto (up to {c.budget})" if c.auto_budget else c.budget) \
            if self.runtime.engine.builder is not None else "- (no draft)"
        return (f"temperature {s.temperature} · top_p {s.top_p} · top_k {s.top_k} · min_p {s.min_p} · "
                f"repetition_penalty {s.repetition_penalty} · presence_penalty {s.presence_penalty} · "
                f"frequency_penalty {s.frequency_penalty} · seed {s.seed} · max_new_tokens "
                f"{self.max_new_tokens} · budget {budget} · accept {c.accept.label}"
                + (" (LOSSY)" if c.accept.relaxed else ""))

    def cmd_stats(self, _rest: str) -> None:
        if self.last is None:
            self.console.print("no answer yet", style="dim")
            return
        from specexec.profiler import summary_table
        self.console.print(summary_table(self.last.profile, "profile of the last answer"))

    def cmd_save(self, rest: str) -> None:
        if not rest:
            raise ConfigError("/save needs a file name, e.g. /save chat.json")
        obj = {"format": SAVE_FORMAT, "version": 1, "system": self.system, "messages": self.messages,
               "sampling": asdict(self.sampling)}
        path = Path(rest).expanduser()
        try:
            path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"/save cannot write {path}: {e.strerror or type(e).__name__}") from None
        self.console.print(f"saved {len(self.messages)} messages to {rest}", style="dim", highlight=False)

    def cmd_load(self, rest: str) -> None:
        if not rest:
            raise ConfigError("/load needs a file name, e.g. /load chat.json")
        system, messages = read_conversation(Path(rest).expanduser())
        self.system, self.messages, self.last = system, messages, None
        self.console.print(f"loaded {len(messages)} messages from {rest}", style="dim", highlight=False)

    def cmd_retry(self, _rest: str) -> None:
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            raise ConfigError("nothing to retry yet: send a message first")
        user = self.messages[-2]["content"]
        self.messages = self.messages[:-2]
        self.ask(user)


COMMANDS: dict[str, Callable[[ChatSession, str], bool | None]] = {
    "help": ChatSession.cmd_help, "?": ChatSession.cmd_help, "exit": ChatSession.cmd_exit,
    "quit": ChatSession.cmd_exit, "reset": ChatSession.cmd_reset, "clear": ChatSession.cmd_reset,
    "system": ChatSession.cmd_system, "set": ChatSession.cmd_set, "stats": ChatSession.cmd_stats,
    "save": ChatSession.cmd_save, "load": ChatSession.cmd_load, "retry": ChatSession.cmd_retry,
}


def _out_of_memory(e: BaseException) -> bool:
    """Whether `e` (or what it wraps, e.g. the pager's "loading layer i failed") is running out of memory."""
    import torch

    while e is not None:
        if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__
    return False


def _free_cuda_cache() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def read_conversation(path: Path) -> tuple[str | None, list[dict[str, str]]]:
    """(system, messages) from a /save file; ConfigError naming the file for anything malformed."""
    obj = read_json(path, f"{path} (a saved conversation?)", ConfigError)   # bad bytes, depth, lone surrogates
    if not isinstance(obj, dict) or obj.get("format") != SAVE_FORMAT:
        raise ConfigError(f"{path} is not a conversation written by /save (format {SAVE_FORMAT!r})")
    system, messages = obj.get("system"), obj.get("messages")
    if system is not None and not isinstance(system, str):
        raise ConfigError(f"{path}: system must be a string or null")
    if not isinstance(messages, list):
        raise ConfigError(f"{path}: messages must be a list")
    for i, m in enumerate(messages):
        role = "user" if i % 2 == 0 else "assistant"
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] != role \
                or not isinstance(m["content"], str):
            raise ConfigError(f"{path}: message {i} must be {{\"role\": \"{role}\", \"content\": TEXT}} "
                              "(user and assistant turns alternate, user first)")
        check_prompt_text(m["content"], f"{path}: message {i}", allow_empty=True)
    if messages and messages[-1]["role"] != "assistant":
        raise ConfigError(f"{path}: the last message must be an answer (role assistant)")
    return system, [dict(m) for m in messages]


def stats_line(p: dict) -> str:
    """The one dim line after an answer."""
    rate = f"{p['decode_tok_s']:.1f} tok/s" if p.get("decode_tok_s") else "– tok/s"
    ttft = f"{p['ttft_s']:.2f} s" if p.get("ttft_s") is not None else "–"
    per = f"{p['tokens_per_step']:.2f}" if p.get("tokens_per_step") else "–"
    return (f"{p.get('generated', 0)} tokens · {rate} · {per} tokens/pass · first token {ttft} · prefill "
            f"{p.get('prompt_tokens', 0)} tokens ({p.get('reused_tokens', 0)} reused)" + relaxed_note(p))


# -------------------------------------------------------------------- the loop

def repl(session: ChatSession, read_line: Callable[[str], str] = input,
         hold: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> int:
    """Read and handle messages until /exit or end of input; Ctrl-C at the prompt only clears the line. `hold`:
    what surrounds handling a message (the terminal: input_held)."""
    while True:
        try:
            message = read_message(read_line)
        except KeyboardInterrupt:
            session.console.print("^C (Ctrl-D or /exit leaves)", style="dim", highlight=False, markup=False)
            continue
        except UnicodeDecodeError as e:              # the terminal sent bytes that are not UTF-8 (a paste)
            session.console.print(f"error: that input is not UTF-8 text (byte {e.object[e.start]:#04x}); type or "
                                  "paste UTF-8", style="red", highlight=False, markup=False)
            continue
        if message is None:
            session.write("\n")
            return 0
        try:
            with hold():
                if not session.handle(message):
                    return 0
        except KeyboardInterrupt:
            session.console.print("^C", style="dim", highlight=False, markup=False)


# -------------------------------------------------------------------- entry point

def _piped(session: ChatSession) -> int:
    """Non-terminal stdin: all of it is one user turn; only the answer goes to stdout."""
    text = read_stdin()                  # bytes decoded as UTF-8 here: invalid input is one ConfigError line
    if not text.strip():
        raise ConfigError("stdin is empty: pipe a message in, or run `specexec chat` in a terminal")
    answer = session.ask(text.rstrip("\n"))
    return 130 if answer.interrupted else 0


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    interactive = sys.stdin.isatty()
    common.apply_catalog_defaults(args, console if interactive else None)
    config = common.engine_config(args, auto_budget=True)
    sampling = common.sampling_params(args)
    offload = common.offload_config(args)
    common.prompt_cache_size(args)
    if common.check_draft(args, config, default_self=True) and interactive:
        from specexec.drafters.registry import kind_named     # imports torch: only once the chat runs

        kind = kind_named(args.draft)
        how = f"{kind.said} (--draft {kind.name}" if kind is not None else "the target itself (--draft self"
        console.print(f"no draft named or recommended: drafting with {how}; --no-draft decodes with the target "
                      "alone)", style="dim", highlight=False, markup=False)
    runtime = common.load_runtime(args, config, console if interactive else None, offload)
    common.attach_prompt_cache(args, runtime, console)
    try:
        return _session(args, runtime, sampling, console, interactive)
    finally:
        runtime.engine.close()                    # the offloaded target's pager thread


def _session(args: argparse.Namespace, runtime: Runtime, sampling: SamplingParams, console: Console,
             interactive: bool) -> int:
    quiet = Console(stderr=True, soft_wrap=True, quiet=not args.profile)
    session = ChatSession(runtime, sampling, args.system, console if interactive else quiet, write_text,
                          args.max_new_tokens, args.profile)
    if not interactive:
        return _piped(session)
    from cli.generate import print_load_summary

    print_load_summary(console, runtime)
    console.print(f"context {runtime.context} tokens · answers up to {session.max_new_tokens} tokens · "
                  "/help for commands · Ctrl-D or /exit leaves", style="dim", highlight=False)
    try:
        import readline  # noqa: F401 -- line editing and history for input()
    except ImportError:
        pass
    return repl(session, hold=input_held)
