"""`specexec` entry point: parses the command line, runs one subcommand, maps failures to exit codes.

Every failure a user can cause ends as ONE line `error: ...` on stderr and exit code 2 (1 for a bug, 130 for
Ctrl-C, 143 for SIGTERM, after the same cleanups as Ctrl-C); `--debug` (before or after the subcommand) shows
the traceback instead. A closed standard output (`specexec models | head -3`) is a normal end: exit 0, nothing
more printed (errors.closed_stdout). Subcommands live in their own modules with `add_parser(subparsers)` and
`run(args) -> int`.

Does not know: models, tokenizers or generation; the subcommands do.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
import traceback
from typing import NoReturn

import specexec
from specexec.options import choice_error
from cli import help as helptext
from cli import threads
from cli.errors import (INTERRUPT_EXIT, TERMINATED_EXIT, Terminated, UsageError, as_typed, closed_stdout, report,
                        sigterm_raises)

# name -> the module with add_parser(subparsers) and run(args), imported only when the command line names it
# (or names no command: the top-level --help lists them all), so parsing never imports more than it runs.
COMMANDS = {"chat": "cli.chat", "generate": "cli.generate", "serve": "cli.serve.command", "launch": "cli.launch",
            "demo": "cli.demo", "convert": "cli.convert", "models": "cli.catalog", "plan": "cli.plan",
            "doctor": "cli.doctor", "cache": "cli.cache"}


# `specexec bench <name>`: each module has add_parser(bench_subparsers) and run(args), like COMMANDS.
# A plain `specexec bench --model ...` (no name) is the end-to-end benchmark, cli/bench/main.py.
BENCH_COMMANDS = {"builders": "cli.bench.builders", "accept": "cli.bench.accept", "relaxed": "cli.bench.relaxed",
                  "stream": "cli.bench.components.stream", "attention": "cli.bench.components.attention",
                  "kernels": "cli.bench.components.kernels", "decode": "cli.bench.components.decode",
                  "moe": "cli.bench.components.moe", "hybrid": "cli.bench.components.hybrid",
                  "serve": "cli.bench.serve", "agents": "cli.bench.agents"}


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing a usage banner and exiting; a value
    outside a flag's choices is said as every other choice error is (options.choice_error)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.add_help:
            self.add_argument("--help-all", action=helptext.HelpAll)

    def format_help(self, full: bool = False) -> str:
        """--help: the essential options and where the rest are; full (--help-all): every option under its
        heading (cli/help.py)."""
        return helptext.format_help(self, full)

    def print_help(self, file=None, full: bool = False) -> None:
        self._print_message(self.format_help(full), file or sys.stdout)

    words: list[str] = []          # the command line being parsed (main sets it): where a mistyped flag is found

    def mistyped(self) -> str:
        """'unknown option --modle; did you mean --model?' for the first word that looks like one of this
        parser's options but is none; '' when there is none."""
        known = {o[2:]: o for o in self._option_string_actions if o.startswith("--")}
        words = self.words[: self.words.index("--")] if "--" in self.words else self.words
        for word in words:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                close = difflib.get_close_matches(flag[2:], list(known), n=1, cutoff=0.75)
                if close:
                    return f"unknown option {flag}; did you mean {known[close[0]]}?"
        return ""

    def error(self, message: str) -> NoReturn:
        typo = self.mistyped() if message.startswith(("the following arguments are required", "one of the arguments",
                                                      "unrecognized arguments")) else ""
        if typo:
            raise UsageError(f"{typo} (see {self.prog} --help)")
        choice = INVALID_CHOICE.fullmatch(message)
        if choice:
            flag, value, names = choice.groups()
            value = value[1:-1] if value[:1] == value[-1:] == "'" else value      # 'nf5' (3.11) or nf5 (3.12+)
            name = flag if flag.startswith("-") else flag.lower()                # COMMAND -> command
            listed = [n.strip(" '") for n in names.split(",")]
            message = str(choice_error(name, value, listed))
            close = difflib.get_close_matches(value, listed, n=1, cutoff=0.6) if not flag.startswith("-") else []
            message += f"; did you mean {close[0]}?" if close else ""           # a command's name, mistyped
        raise UsageError(f"{message} (see {self.prog} --help)")


INVALID_CHOICE = re.compile(r"argument ([^:]+): invalid choice: (.*) \(choose from (.*)\)")


def build_parser(argv: list[str] | None = None) -> Parser:
    """The command line's parser. With `argv`, only the commands it names are imported (the others are bare
    names argparse can still choose between); without, every command is."""
    from cli import catalog as models_cmd

    named = None if argv is None else set(argv)
    parser = Parser(prog="specexec", description="Speculative decoding with large draft trees, for models "
                    "whose weights stream from RAM or SSD. Model families: "
                    f"{models_cmd.family_names_line()} (`specexec models` lists their architectures).")
    parser.add_argument("--version", action="version", version=f"specexec {specexec.__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    everything = named is None or not named & {*COMMANDS, "bench"}
    for name, module in COMMANDS.items():
        if not (everything or name in named):
            sub.add_parser(name)                  # never parsed this time: a name to choose between
            continue
        command = importlib.import_module(module)
        p = command.add_parser(sub)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
        threads.add_flag(p)
        p.set_defaults(handler=command.run, parser=p)
    if everything or "bench" in named:
        add_bench_group(sub, named)
    else:
        sub.add_parser("bench")
    return parser


def add_bench_group(sub: argparse._SubParsersAction, named: set[str] | None = None) -> Parser:
    """The `bench` command group: the end-to-end benchmark (cli/bench/main.py) when no name follows, else one
    sub-subcommand per module in BENCH_COMMANDS (imported only when `named`, the command line's words, has it)."""
    from cli.bench import main as bench

    names = ", ".join(BENCH_COMMANDS)
    group = sub.add_parser("bench", help=f"end-to-end benchmark vs baselines (or: bench {names} ...)",
                           description=bench.DESCRIPTION + f" Other benchmarks: `specexec bench {names} --help`.",
                           allow_abbrev=False)   # a sub-benchmark's flag (--k) must not read as the group's (--kv-*)
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    bench.add_run_arguments(group)
    threads.add_flag(group)
    group.set_defaults(handler=bench.run, parser=group)
    benches = group.add_subparsers(dest="bench_command", metavar="BENCH", required=False, parser_class=Parser)
    for name, module in BENCH_COMMANDS.items():
        if named is not None and name not in named:
            benches.add_parser(name)
            continue
        command = importlib.import_module(module)
        p = command.add_parser(benches)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
        threads.add_flag(p)
        p.set_defaults(handler=command.run, parser=p)
    return group


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    args = None
    if argv[:1] == ["--version"]:                 # at once: nothing else to import
        print(f"specexec {specexec.__version__}")
        return 0
    Parser.words = argv
    try:
        with sigterm_raises():
            args, unknown = build_parser(argv).parse_known_args(argv)
            if unknown:                           # said by the subcommand's parser: its --help is the one to read
                args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            if getattr(args, "allow_outside_shards", False):
                from offload.formats.checkpoint import allow_outside_shards
                allow_outside_shards()            # the user means it: weight files outside the checkpoint
            with threads.applied(args):
                return int(args.handler(args) or 0)
    except Exception as e:                        # noqa: BLE001 -- the one place exceptions become exit codes
        if closed_stdout(e):                      # the reader went away (`| head`): a normal end, as for any tool
            return 0
        if debug:
            traceback.print_exc()
        return report(as_typed(e, getattr(args, "parser", None), args))
    except Terminated:
        print("\nterminated", file=sys.stderr, flush=True)
        return TERMINATED_EXIT
    except SystemExit as e:                       # --help, --version: argparse's own exits
        if closed_stdout(e):                      # rich's exit on a broken pipe
            return 0
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return INTERRUPT_EXIT


def run() -> NoReturn:
    """Console-script entry point. Output still buffered is written here, so a reader that went away meanwhile
    is a normal end too (not Python's "Exception ignored" at exit)."""
    code = main()
    try:
        sys.stdout.flush()
    except OSError as e:
        if not closed_stdout(e):
            raise
        code = code or 0
    sys.exit(code)


if __name__ == "__main__":
    run()
