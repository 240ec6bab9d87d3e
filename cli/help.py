"""--help short, --help-all whole: what a command's help shows, and help text read only when shown.

`--help` shows the usage and the options most runs need (ESSENTIAL, in their order), then one line naming the
headings the rest sit under and `--help-all`, which shows every option under its heading (model, engine,
sampling, memory and offloading, ...). A command without those shared groups shows all its options either way. A help text that
must read a registry whose module imports torch (the verifiers' names) is a LazyHelp: read when a help that
shows it is printed, so parsing, a short --help and an argument error never import torch.

Does not know: the commands, their flags' meanings (cli/args.py and the command modules).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

# The options a short --help shows (when the command has them); the rest wait for --help-all.
ESSENTIAL = frozenset((
    "-h", "--help", "--help-all", "--version", "--debug", "--model", "--draft", "--no-draft", "--prompt",
    "--prompt-file", "--max-new-tokens", "--temperature", "--device", "--threads", "--json", "--budget", "--chat",
    "--system", "--host", "--port", "--api-key", "--served-model-name", "--budgets", "--limit", "--prompts",
    "--configs", "--gpu-memory", "--ram-budget", "--out", "--local", "--endpoint", "--context",
))
# A command with the shared groups (cli/args.py: the decoding commands) or a late help text (plan) shows the
# essential options on --help; the others (models, the component benchmarks) show them all.
HEADINGS = ("model", "engine", "sampling", "memory and offloading")


class LazyHelp:
    """A help text made when shown (its registry's module imports torch)."""

    def __init__(self, make: Callable[[], str]) -> None:
        self.make = make

    def __str__(self) -> str:
        return self.make()

    def strip(self) -> str:                     # argparse asks whether there is any help
        return "lazy"

    def __getattr__(self, name: str):           # anything else a str does (startswith, ...), on the text
        return getattr(str(self), name)

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class HelpAll(argparse.Action):
    """--help-all: every option under its heading, then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show every option, under headings, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.print_help(full=True)
        parser.exit()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def is_short(parser: argparse.ArgumentParser) -> bool:
    """Whether this parser's --help leaves options for --help-all: it has the shared groups, or a help text read
    late (its registry imports torch: a short --help never reads it)."""
    return (any(g.title in HEADINGS for g in parser._action_groups)
            or any(isinstance(a.help, LazyHelp) for a in parser._actions))


def shown(action: argparse.Action, full: bool) -> bool:
    return full or not action.option_strings or any(o in ESSENTIAL for o in action.option_strings)


def format_help(parser: argparse.ArgumentParser, full: bool) -> str:
    """The help text: whole (every group under its title) or short (the essential options in one section,
    then where the rest are)."""
    full = full or not is_short(parser)
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if shown(a, full)]
    for action in actions:                          # read lazy texts now, for this help only
        if isinstance(action.help, LazyHelp):
            action.help = str(action.help)
    if full:
        formatter.add_usage(parser.usage, actions, parser._mutually_exclusive_groups)
    else:                                           # what must be given, then [options]
        must = [a for a in actions if a.required or not a.option_strings or any(
            g.required and a in g._group_actions for g in parser._mutually_exclusive_groups)]
        usage = parser._get_formatter()._format_usage(None, must, parser._mutually_exclusive_groups, "")
        formatter.add_usage(f"{usage.strip()} [options]", [], [])
    formatter.add_text(None if parser.description is None else str(parser.description))
    if full:
        for group in parser._action_groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
    else:
        for title, wanted in (("arguments", lambda a: not a.option_strings), ("main options", lambda a: True)):
            chosen = [a for a in actions if wanted(a) and (title == "arguments") != bool(a.option_strings)]
            if chosen:
                formatter.start_section(title)
                formatter.add_arguments(chosen)
                formatter.end_section()
        rest = [g.title for g in parser._action_groups
                if any(not shown(a, False) for a in g._group_actions)]
        hidden = sum(not shown(a, False) for a in _options(parser))
        formatter.add_text(f"{hidden} more options ({', '.join(rest)}): {parser.prog} --help-all")
    formatter.add_text(parser.epilog)
    return formatter.format_help()
