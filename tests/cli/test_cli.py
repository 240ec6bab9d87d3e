"""The `specexec` command line: the generate --json contract, greedy exactness through the CLI, stop strings,
one-line errors with exit code 2 for every user mistake, real subprocesses, and the demo."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli.args import engine_config
from cli.main import build_parser, main
from specexec.config import EngineConfig, SamplingParams
from specexec.options import ConfigError
from specexec.runtime.assembly import Runtime
from specexec.runtime.detokenizer import Detokenizer

ROOT = Path(__file__).resolve().parents[2]
STATS_KEYS = {"steps", "tokens_per_step", "prefill_tok_s", "decode_tok_s", "draft_ms", "target_ms", "tree_size",
              "budget", "builder"}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP barriers make each
    small matmul up to 1000x slower; one thread keeps these tests at seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generate(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    """Run `generate ... --json` in-process; return the parsed JSON line (asserting it is the only line)."""
    assert main(["generate", *argv, "--json"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1, out
    return json.loads(out)


def _assert_one_line_error(capsys: pytest.CaptureFixture, code: int, pattern: str = "") -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert "\n" not in err and err.startswith("error: "), err
    assert pattern.lower() in err.lower(), err
    return err


# ------------------------------------------------------------------------------------------ the contract

def test_generate_json_contract(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    target, _ = tiny_pair
    obj = _generate(capsys, "--model", str(target), "--draft", str(tiny_perturbed_draft), "--prompt", "Hello",
                    "--max-new-tokens", "12", "--budget", "8")
    assert set(obj) == {"text", "token_ids", "stats"}
    assert STATS_KEYS <= set(obj["stats"])          # the contract: at least these keys
    assert 1 <= len(obj["token_ids"]) <= 12 and all(isinstance(t, int) for t in obj["token_ids"])
    stats = obj["stats"]
    assert stats["builder"] == "specexec" and stats["budget"] == 8 and 0 < stats["tree_size"] <= 8
    assert stats["tokens_per_step"] == pytest.approx(len(obj["token_ids"]) / stats["steps"], abs=1e-3)
    assert stats["tokens_per_step"] > 1          # a 1%-noise draft is accepted somewhere in 12 tokens


def test_no_draft_equals_draft_at_temperature_zero(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    target, unrelated = tiny_pair
    common = ["--model", str(target), "--prompt", "The quick brown fox", "--max-new-tokens", "24",
              "--dtype", "float32"]
    base = _generate(capsys, *common, "--no-draft")
    assert base["stats"]["tokens_per_step"] == 1.0 and base["stats"]["builder"] == "none"
    for draft in (tiny_perturbed_draft, unrelated):
        spec = _generate(capsys, *common, "--draft", str(draft), "--budget", "16")
        assert spec["token_ids"] == base["token_ids"] and spec["text"] == base["text"]


def test_plain_output_is_the_streamed_text(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    argv = ["--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--prompt", "Hello",
            "--max-new-tokens", "10"]
    obj = _generate(capsys, *argv)
    assert main(["generate", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.out == obj["text"] + "\n"
    assert "tokens/step" in captured.err and "layers" in captured.err


def test_chat_and_prompt_file(capsys, tiny_llama, tmp_path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello there", encoding="utf-8")
    common = ["--model", str(tiny_llama), "--no-draft", "--max-new-tokens", "5"]
    from_file = _generate(capsys, *common, "--prompt-file", str(prompt))
    assert from_file == _generate(capsys, *common, "--prompt", "Hello there") | {"stats": from_file["stats"]}
    chat = _generate(capsys, *common, "--prompt", "Hello there", "--chat", "--system", "Be brief.")
    assert len(chat["token_ids"]) <= 5


def test_eos_is_kept_and_ends_generation(tiny_llama) -> None:
    rt = Runtime.load(str(tiny_llama), None, EngineConfig(max_new_tokens=8))
    prompt = rt.encode("Hello")
    first = [t for step in rt.generate_ids(prompt, 8) for t in step]
    rt.engine.eos_ids = {first[2]}                      # pretend the third token is EOS
    ids = [t for step in rt.generate_ids(prompt, 8) for t in step]
    assert ids == first[: first.index(first[2]) + 1]


# ------------------------------------------------------------------------------------------ stop strings

def _stop_candidate(detok: Detokenizer, ids: list[int]) -> tuple[int, str]:
    """(k, s): s = the text of tokens k and k+1, printable, whose first occurrence starts at token k."""
    full = detok.text(ids)
    for k in range(1, len(ids) - 2):
        before, s = detok.text(ids[:k]), detok.text(ids[:k + 2])[len(detok.text(ids[:k])):]
        if s.strip() and s.isprintable() and full.find(s) == len(before):
            return k, s
    pytest.skip("no printable two-token stop string in this output")


def test_stop_string_ends_generation_before_it(tiny_pair, tiny_perturbed_draft) -> None:
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8))
    prompt = rt.encode("The quick brown fox")
    full = [t for step in rt.generate_ids(prompt, 40) for t in step]
    detok = Detokenizer(rt.tokenizer, prompt)
    k, stop = _stop_candidate(detok, full)
    steps = list(rt.generate_ids(prompt, 40, SamplingParams(), stop=["never-in-the-output", stop]))
    ids = [t for step in steps for t in step]
    assert ids == full[:k]
    assert stop not in detok.text(ids)


# ------------------------------------------------------------------------------------------ one-line errors

def _gpt2_checkpoint(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


ERROR_CASES = {
    "missing model": (lambda p: ["--model", str(p["tmp"] / "nope"), "--no-draft"], "does not exist"),
    "unsupported architecture": (lambda p: ["--model", str(p["gpt2"]), "--no-draft"], "GPT2LMHeadModel"),
    "tokenizers disagree": (lambda p: ["--model", str(p["llama"]), "--draft", str(p["mismatched"])],
                            "tokenizers disagree"),
    "draft and no-draft": (lambda p: ["--model", str(p["llama"]), "--draft", str(p["llama"]), "--no-draft"],
                           "not allowed with"),
    "neither draft nor no-draft": (lambda p: ["--model", str(p["llama"])], "--no-draft"),
    "budget 0": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--budget", "0"], "--budget must be"),
    "budget not a number": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--budget", "many"], "--budget"),
    "temperature -1": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--temperature", "-1"], "--temperature must be"),
    "top-p 1.5": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--top-p", "1.5"], "--top-p must be"),
    "unknown builder": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--builder", "magic"], "unknown --builder 'magic'; choose one of"),
    "unknown dtype": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--dtype", "int3"], "unknown --dtype 'int3'; choose one of"),
    "system without chat": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--system", "x"], "--chat"),
    "prompt too long": (lambda p: ["--model", str(p["llama"]), "--no-draft", "--max-new-tokens", "600"], "512"),
}


@pytest.fixture
def paths(tmp_path, tiny_llama, tiny_mismatched_draft) -> dict[str, Path]:
    return {"tmp": tmp_path, "llama": tiny_llama, "mismatched": tiny_mismatched_draft,
            "gpt2": _gpt2_checkpoint(tiny_llama, tmp_path / "gpt2")}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_are_one_line_with_exit_code_2(capsys, paths, case) -> None:
    make_argv, pattern = ERROR_CASES[case]
    code = main(["generate", *make_argv(paths), "--prompt", "Hello", "--json"])
    _assert_one_line_error(capsys, code, pattern)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys, tiny_llama) -> None:
    code = main(["generate", "--model", str(tiny_llama), "--no-draft", "--prompt", "x", "--device", "cuda"])
    _assert_one_line_error(capsys, code, "--device cuda but torch sees no CUDA device; use --device cpu")


def test_missing_prompt_file(capsys, tiny_llama, tmp_path) -> None:
    code = main(["generate", "--model", str(tiny_llama), "--no-draft", "--prompt-file", str(tmp_path / "no.txt")])
    _assert_one_line_error(capsys, code, "no.txt")


def test_usage_errors(capsys) -> None:
    _assert_one_line_error(capsys, main([]), "required")
    _assert_one_line_error(capsys, main(["generate", "--prompt", "x"]), "--model")
    _assert_one_line_error(capsys, main(["frobnicate"]), "unknown command 'frobnicate'; choose one of: chat")


def test_debug_shows_the_traceback(capsys, tmp_path) -> None:
    code = main(["generate", "--model", str(tmp_path / "nope"), "--no-draft", "--prompt", "x", "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_help_exits_zero(capsys) -> None:
    assert main(["generate", "--help"]) == 0
    assert "--no-draft" in capsys.readouterr().out


def _options(command: str) -> dict[str, str]:
    """--flag -> its help text in `command`'s parser."""
    from cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and command in a.choices).choices[command]
    return {o: a.help for a in sub._actions for o in a.option_strings}


def test_plan_and_generate_share_each_flag_and_its_help() -> None:
    """`specexec plan` declares none of generate's flags again: each shared one comes from cli/args.py with
    its one text (plan may say another default: it applies no models.yaml defaults)."""
    from cli.args import _flags

    plan, generate, shared = _options("plan"), _options("generate"), _flags()
    common = set(plan) & set(shared)
    assert len(common) >= 12 and common <= set(generate)
    for flag in common - {"--model"}:                       # plan's --model reads config.json only
        text = shared[flag].text() if callable(shared[flag].text) else shared[flag].text    # a registry's, read late
        assert str(plan[flag]).startswith(text) and str(generate[flag]).startswith(text), flag


# ------------------------------------------------------------------------------------------ subprocesses

def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
def test_subprocess_json_is_exactly_one_line(tiny_pair, tiny_perturbed_draft) -> None:
    proc = _cli("generate", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft),
                "--prompt", "Hello", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert len(lines) == 2 and lines[1] == "", proc.stdout
    assert len(json.loads(lines[0])["token_ids"]) <= 6


@pytest.mark.slow
def test_subprocess_errors_exit_2_in_one_line(tmp_path) -> None:
    proc = _cli("generate", "--model", str(tmp_path / "nope"), "--no-draft", "--prompt", "x", "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: "), proc.stderr


# ------------------------------------------------------------------------------------------ demo

def test_demo_runs_and_caches(capsys, tmp_path, monkeypatch) -> None:
    from cli.demo import cache_dir, ensure_models

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECEXEC_CACHE")                          # the cache root falls back to XDG's
    assert main(["demo", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    for needle in ("built demo models", "tok/pass", "budget 8", "target only", "meaningless",
                   "specexec generate --model PATH --draft PATH"):
        assert needle in err, needle
    assert "NO" not in err.split("greedy decoding")[1]
    assert err.index("What this shows: speculative decoding emits exactly") < err.index("greedy decoding")  # first
    assert err.strip().splitlines()[-1].startswith("Next, with these checkpoints")
    assert "specexec chat --model demo" in err.strip().splitlines()[-1]
    assert cache_dir() == tmp_path / "specexec" / "demo" / cache_dir().name
    assert ensure_models(cache_dir())[2] is False                # built once, then reused
    assert main(["models", "--json", "--local"]) == 0           # the demo's pair by name
    local = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert local["demo"]["local_path"] == str(cache_dir() / "target") and local["demo"]["drafts"] == ["demo-draft"]
    assert local["demo-draft"]["local_path"] == str(cache_dir() / "draft")
    assert main(["generate", "--model", "demo", "--prompt", "The quick brown fox", "--max-new-tokens", "4",
                 "--json"]) == 0                                  # what the last line says to run, drafting
    out = json.loads(capsys.readouterr().out)                    # with demo-draft (the entry's draft)
    assert len(out["token_ids"]) == 4 and out["stats"]["builder"] == "specexec"
    _demo_serves_as_demo_with_tools(monkeypatch)


def _demo_serves_as_demo_with_tools(monkeypatch) -> None:
    """`serve --model demo` names the model `demo` (not its directory, `target`), and the demo's chat template
    writes tool calls in a format the server knows (hermes)."""
    import importlib.util

    from transformers import AutoTokenizer

    from cli.demo import cache_dir
    from specexec.serving.tools import format_for

    template = AutoTokenizer.from_pretrained(str(cache_dir() / "target")).chat_template
    assert format_for(template) is not None and format_for(template).name == "hermes"
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("starlette") is None:
        return
    from cli.serve import command

    served = {}
    monkeypatch.setattr(command, "serve", lambda runtime, sock, name, *a, **k: served.update(name=name, aliases=a[4]))
    assert main(["serve", "--model", "demo", "--no-draft", "--port", "0"]) == 0
    assert served == {"name": "demo", "aliases": ()}
    assert main(["serve", "--model", str(cache_dir() / "target"), "--no-draft", "--port", "0",
                 "--served-model-name", "a", "b", "c"]) == 0
    assert served == {"name": "a", "aliases": ("b", "c")}


def test_demo_by_name_before_the_demo_says_what_builds_it(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    code = main(["generate", "--model", "demo", "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"error: model 'demo' is not on this machine yet: {tmp_path}/demo/v2/target has no "
                                 "config.json (`specexec demo` builds it)")


def test_streamed_pieces_rebuild_multibyte_text(tiny_llama) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    text = "héllo wörld 你好 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok, tok("x")["input_ids"])
    shown, pieces = 0, []
    for n in range(1, len(ids) + 1):                     # one token per step, as the slowest stream would
        stable = detok.stable_text(ids[:n])
        pieces.append(stable[shown:])
        shown = max(shown, len(stable))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split())                    # multi-byte characters span several tokens


def test_empty_prompt_is_a_config_error(tiny_qwen2) -> None:
    rt = Runtime.load(str(tiny_qwen2), None, EngineConfig())
    with pytest.raises(ConfigError, match="prompt is empty"):
        list(rt.generate_ids([], 4))


def test_generate_defaults_to_budget_auto_and_a_number_fixes_it(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    target, _ = tiny_pair
    argv = ["generate", "--model", str(target), "--draft", str(tiny_perturbed_draft), "--prompt", "Hello",
            "--max-new-tokens", "6"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "budget auto (up to 1024 tokens)" in err and " · cpu · loaded in" in err
    assert main(argv + ["--budget", "8"]) == 0
    assert "budget 8 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("cuda", [False, True])
def test_decoding_commands_default_to_cuda_where_torch_sees_one(monkeypatch, cuda: bool) -> None:
    """generate, chat, serve and bench without --device: CUDA when torch sees a GPU, else the CPU (their parsers
    leave the flag unset and engine_config chooses); --device given wins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"], ["bench"]):
        args = parser.parse_args([*command, "--model", "m"])
        assert engine_config(args).device == ("cuda" if cuda else "cpu"), command
        args = parser.parse_args([*command, "--model", "m", "--device", "cpu", "--budget", "8"])
        config = engine_config(args, auto_budget=True)
        assert config.device == "cpu" and not config.auto_budget and config.budget == 8, command


def test_threads_flag_sets_the_command_s_threads_and_the_load_line_says_them(capsys, monkeypatch, tiny_llama) -> None:
    import torch

    from cli.generate import print_load_summary

    seen = []
    monkeypatch.setattr("cli.generate.print_load_summary",
                        lambda console, runtime: (seen.append(torch.get_num_threads()),
                                                  print_load_summary(console, runtime)))
    before = torch.get_num_threads()
    assert main(["generate", "--model", str(tiny_llama), "--no-draft", "--prompt", "hi", "--max-new-tokens", "2",
                 "--threads", "3"]) == 0
    assert seen == [3] and torch.get_num_threads() == before                 # set for the run, then restored
    target = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("target "))
    assert " · 3 threads" in target, target
    for cmd in (["generate", "--model", str(tiny_llama), "--prompt", "x"], ["models"], ["plan", "--model", "x"]):
        assert main([*cmd, "--threads", "0"]) == 2
        assert capsys.readouterr().err.strip() == "error: --threads must be in [1, 1024], got 0"
