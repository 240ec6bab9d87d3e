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
import re
import sys
import traceback
from typing import NoReturn

import specexec
from specexec.options import choice_error
from cli import chat, convert, demo, doctor, generate, launch, plan, threads
from cli.serve import command as serve
from offload.formats.checkpoint import allow_outside_shards
from cli.bench import main as bench
from cli import catalog as models_cmd
from cli.bench import accept as bench_accept
from cli.bench import relaxed as bench_relaxed
from cli.bench.components import attention as bench_attention
from cli.bench.components import decode as bench_decode
from cli.bench.components import hybrid as bench_hybrid
from cli.bench import builders as bench_builders
from cli.bench import serve as bench_serve
from cli.bench.components import kernels as bench_kernels
from cli.bench.components import moe as bench_moe
from cli.bench.components import stream as bench_stream
from cli.errors import (INTERRUPT_EXIT, TERMINATED_EXIT, Terminated, UsageError, as_typed, closed_stdout, report,
                        sigterm_raises)

COMMANDS = (chat, generate, serve, launch, demo, convert, models_cmd, plan, doctor)


# `specexec bench <name>`: each module has add_parser(bench_subparsers) and run(args), like COMMANDS.
# A plain `specexec bench --model ...` (no name) is the end-to-end benchmark, cli/bench/main.py.
BENCH_COMMANDS = (bench_builders, bench_accept, bench_relaxed, bench_stream, bench_attention, bench_kernels,
                  bench_decode, bench_moe, bench_hybrid, bench_serve)


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing a usage banner and exiting; a value
    outside a flag's choices is said as every other choice error is (options.choice_error)."""

    def error(self, message: str) -> NoReturn:
        choice = INVALID_CHOICE.fullmatch(message)
        if choice:
            flag, value, names = choice.groups()
            value = value[1:-1] if value[:1] == value[-1:] == "'" else value      # 'nf5' (3.11) or nf5 (3.12+)
            name = flag if flag.startswith("-") else flag.lower()                # COMMAND -> command
            message = str(choice_error(name, value, [n.strip(" '") for n in names.split(",")]))
        raise UsageError(f"{message} (see {self.prog} --help)")


INVALID_CHOICE = re.compile(r"argument ([^:]+): invalid choice: (.*) \(choose from (.*)\)")


def build_parser() -> Parser:
    parser = Parser(prog="specexec", description="Speculative decoding with large draft trees, for models "
                    "whose weights stream from RAM or SSD. Model families: "
                    f"{models_cmd.family_names_line()} (`specexec models` lists their architectures).")
    parser.add_argument("--version", action="version", version=f"specexec {specexec.__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for command in COMMANDS:
        p = command.add_parser(sub)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
        threads.add_flag(p)
        p.set_defaults(handler=command.run, parser=p)
    add_bench_group(sub)
    return parser


def add_bench_group(sub: argparse._SubParsersAction) -> Parser:
    """The `bench` command group: the end-to-end benchmark (cli/bench/main.py) when no name follows, else one
    sub-subcommand per module in BENCH_COMMANDS."""
    names = ", ".join(c.__name__.rsplit(".", 1)[-1] for c in BENCH_COMMANDS)
    group = sub.add_parser("bench", help=f"end-to-end benchmark vs baselines (or: bench {names} ...)",
                           description=bench.DESCRIPTION + f" Other benchmarks: `specexec bench {names} --help`.",
                           allow_abbrev=False)   # a sub-benchmark's flag (--k) must not read as the group's (--kv-*)
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    bench.add_run_arguments(group)
    threads.add_flag(group)
    group.set_defaults(handler=bench.run, parser=group)
    benches = group.add_subparsers(dest="bench_command", metavar="BENCH", required=False, parser_class=Parser)
    for command in BENCH_COMMANDS:
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
    try:
        with sigterm_raises():
            args, unknown = build_parser().parse_known_args(argv)
            if unknown:                           # said by the subcommand's parser: its --help is the one to read
                args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            if getattr(args, "allow_outside_shards", False):
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
