"""One voice for a user's mistakes: a value outside a flag's choices is said the same way by every command
(argparse's own choices included), a refused value is named by the flag the user typed (never the config field
behind it), an unknown flag points at the subcommand's --help, and a size without a unit is refused with what
to write."""
from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main
from specexec.options import ConfigError, choices, parse_size

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "specexec/checkpoints/configs/llama-3.1-8b-instruct")


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


def test_a_bad_choice_is_said_one_way_by_every_command(capsys, tmp_path: Path) -> None:
    lines = {
        "generate": _error(capsys, ["generate", "--model", CONFIG, "--no-draft", "--prompt", "x", "--quant", "nf5"]),
        "plan": _error(capsys, ["plan", "--model", CONFIG, "--quant", "nf5"]),
        "convert": _error(capsys, ["convert", "--model", CONFIG, "--quant", "nf5", "--out", str(tmp_path)]),
    }
    for command, line in lines.items():
        assert line.startswith("error: unknown --quant 'nf5'; choose one of: "), (command, line)
    formats = ", ".join(choices("--draft-quant"))
    assert lines["convert"] == f"error: unknown --quant 'nf5'; choose one of: {formats} (see specexec convert --help)"
    assert lines["generate"] == lines["plan"] == f"error: unknown --quant 'nf5'; choose one of: auto, {formats}"


@pytest.mark.parametrize("flag, value, said", [
    ("--max-new-tokens", "-5", "--max-new-tokens must be in [1, 10000000], got -5"),
    ("--top-p", "2", "--top-p must be in (0.0, 1.0], got 2.0"),
    ("--repetition-penalty", "0", "--repetition-penalty must be in (0.0, 100.0], got 0.0"),
    ("--dtype", "f32", "unknown --dtype 'f32'; choose one of: auto, float32, bfloat16, float16"),
    ("--device", "tpu", "unknown --device 'tpu'; choose one of: cpu, cuda, cuda:N"),
    ("--budget", "0", "--budget must be in [1, 16384], got 0"),
])
def test_a_refused_value_is_named_by_its_flag(capsys, flag, value, said) -> None:
    line = _error(capsys, ["generate", "--model", CONFIG, "--no-draft", "--prompt", "x", flag, value])
    assert line == f"error: {said}"


def test_a_config_fields_error_keeps_its_own_name() -> None:
    """The renaming is the command line's, for the value the flag gave: the same field name from elsewhere (a
    config.json's top_k of a router, say) is not called --top-k."""
    from cli.errors import as_typed
    from cli.main import build_parser

    args, _ = build_parser().parse_known_args(["generate", "--model", "m", "--prompt", "x", "--top-k", "40"])
    with pytest.raises(ConfigError) as info:
        from specexec.options import check_integer
        check_integer("top_k", 9, low=1, high=8)
    assert str(as_typed(info.value, args.parser, args)) == "top_k must be in [1, 8], got 9"
    with pytest.raises(ConfigError) as info:
        check_integer("top_k", 40, low=0, high=8)
    assert str(as_typed(info.value, args.parser, args)) == "--top-k must be in [0, 8], got 40"


@pytest.mark.parametrize("argv", [
    ["generate", "--model", CONFIG, "--prompt", "x"], ["plan", "--model", CONFIG], ["chat", "--model", CONFIG],
    ["convert", "--model", CONFIG, "--quant", "int4"], ["models"], ["bench", "--model", CONFIG],
    ["bench", "kernels"],
], ids=lambda argv: " ".join(a for a in argv if not a.startswith(("-", "/"))))
def test_an_unknown_flag_points_at_the_subcommands_help(capsys, argv) -> None:
    line = _error(capsys, [*argv, "--bogus"])
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert line == f"error: unrecognized arguments: --bogus (see specexec {command} --help)"


def test_an_unknown_command_is_a_choice_error(capsys) -> None:
    line = _error(capsys, ["frobnicate"])
    assert line.startswith("error: unknown command 'frobnicate'; choose one of: chat, generate")


@pytest.mark.parametrize("text", ["64", "0.5", " 24 "])
def test_a_size_without_a_unit_is_refused_with_what_to_write(text) -> None:
    number = text.strip()
    with pytest.raises(ConfigError, match=rf"^--ram-budget {number} has no unit; add a unit: {number}GB "):
        parse_size(text, "--ram-budget")


def test_sizes_with_a_unit_parse() -> None:
    assert parse_size("64GB") == 64 * 10**9 and parse_size("512MiB") == 512 << 20 and parse_size("100B") == 100
    assert parse_size("1.5g") == 1.5e9


@pytest.mark.parametrize("argv", [
    ["plan", "--model", CONFIG, "--ram-budget", "64"],
    ["plan", "--model", CONFIG, "--gpu-memory", "24"],
    ["generate", "--model", CONFIG, "--no-draft", "--prompt", "x", "--ram-budget", "64"],
])
def test_the_commands_refuse_a_size_without_a_unit(capsys, argv) -> None:
    line = _error(capsys, argv)
    assert f"{argv[-2]} {argv[-1]} has no unit; add a unit: {argv[-1]}GB" in line


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"], ["serve"], ["chat"]])
def test_a_wrong_model_path_is_said_before_the_missing_draft(capsys, tmp_path: Path, command: list[str]) -> None:
    """No --draft: the wrong --model is the mistake to name, not the builder's missing draft."""
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "folder").mkdir()
    said = {str(tmp_path / "nope"): f"error: model path {tmp_path / 'nope'} does not exist; ",
            str(tmp_path / "nope.gguf"): f"error: model path {tmp_path / 'nope.gguf'} does not exist; ",
            str(tmp_path / "notes.txt"): f"error: {tmp_path / 'notes.txt'} is a file; ",
            str(tmp_path / "folder"): f"error: {tmp_path / 'folder'} has no config.json; "}
    for model, start in said.items():
        assert _error(capsys, [command[0], "--model", model, *command[1:]]).startswith(start), (command, model)
