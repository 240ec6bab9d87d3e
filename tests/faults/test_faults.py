"""Faults from outside the program: a disk that fills (or a file-size limit) while the layer cache is written,
the cache deleted or truncated under a running chat, and running out of memory inside a decoding step.

Behaviour checked: one `error:` line and exit 2 where the run cannot go on, never a traceback or a partial
cache (no final dir, no temporary dir, lock free); a rerun without the fault works and answers exactly as a
clean run; a chat survives an out-of-memory step with a one-line hint and its next answer equals a clean
session's (the failed turn leaves nothing behind); the pager thread is stopped when a chat ends.
"""
from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cli.chat import ChatSession
from cli.main import main
from offload.cache import store as C
from offload.cache.manifest import LAYERS_FILE
from specexec.config import EngineConfig, SamplingParams
from specexec.runtime.assembly import Runtime
from tests.cli.screen import Screen
from tests.faults.faults_helpers import (
    Forked, ScriptedTerminal, cache_dir, entries, error_lines, fork_cli, fresh_answer, layer_digests, lock_is_free,
    pager_threads, streamed_runtime)

pytestmark = pytest.mark.timeout(60)

PROMPT = "Hello there"
TURNS = ("Hello there", "Tell me more")


def gen_argv(pair, draft: Path, root: Path) -> list[str]:
    return ["generate", "--model", str(pair[0]), "--draft", str(draft), "--budget", "4", "--max-new-tokens", "12",
            "--chat", "--prompt", PROMPT, "--json", "--offload", "ssd", "--quant", "none", "--cache-dir", str(root)]


def chat_argv(pair, draft: Path, root: Path) -> list[str]:
    return ["chat", "--model", str(pair[0]), "--draft", str(draft), "--budget", "4", "--max-new-tokens", "12",
            "--offload", "ssd", "--quant", "none", "--cache-dir", str(root)]


@pytest.fixture(scope="module")
def clean(tiny_pair, tiny_perturbed_draft, tmp_path_factory) -> dict:
    """A fault-free generate and chat on a fresh cache root: their output, and the cache's digests."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    root = tmp_path_factory.mktemp("clean-cache")
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        assert main(gen_argv(tiny_pair, tiny_perturbed_draft, root)) == 0
    generated = json.loads(out.getvalue())
    return {"root": root, "generate": generated, "digests": layer_digests(cache_dir(tiny_pair[0], root))}


def assert_nothing_kept(root: Path) -> None:
    seen = entries(root)
    assert seen["final"] == [] and seen["temp"] == [], seen
    assert all(lock_is_free(root / ".locks" / lock) for lock in seen["lock"])


def test_disk_full_mid_write_keeps_nothing_and_a_rerun_matches_a_clean_run(
        tiny_pair, tiny_perturbed_draft, clean, tmp_path, monkeypatch, capsys) -> None:
    real, writes = C._write_layer, []

    def fills_up(fd, buf, offset):
        writes.append(offset)
        if len(writes) == 2:                                   # the first layer went to disk, the second fails
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, buf, offset)

    monkeypatch.setattr(C, "_write_layer", fills_up)
    root = tmp_path / "cache"
    assert main(gen_argv(tiny_pair, tiny_perturbed_draft, root)) == 2
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert "disk full" in error_lines(err)[0] and "free space" in error_lines(err)[0]
    assert_nothing_kept(root)

    monkeypatch.setattr(C, "_write_layer", real)
    assert main(gen_argv(tiny_pair, tiny_perturbed_draft, root)) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["token_ids"] == clean["generate"]["token_ids"] and again["text"] == clean["generate"]["text"]
    assert layer_digests(cache_dir(tiny_pair[0], root)) == clean["digests"]


@pytest.fixture(scope="module", autouse=True)
def size_limited(tiny_pair, tmp_path_factory) -> tuple[Forked, Path]:
    """A `convert` process whose files may not exceed 64 KiB (RLIMIT_FSIZE; a tiny-model layer is ~150 KB
    unquantized), started when the module starts so it runs alongside the in-process tests."""
    where = tmp_path_factory.mktemp("size-limited")
    proc = fork_cli(["convert", "--model", str(tiny_pair[0]), "--quant", "none", "--out", str(where / "cache"),
                     "--no-progress"], where / "proc", fsize=64 << 10)
    yield proc, where / "cache"
    proc.kill()


def test_file_size_limit_mid_write_keeps_nothing(tiny_pair, clean, size_limited, capsys) -> None:
    """A real process under RLIMIT_FSIZE: the kernel stops layers.bin part-way with EFBIG (Python ignores
    SIGXFSZ), as a file system with a small largest file would."""
    proc, root = size_limited
    assert proc.wait() == 2, proc.err
    err = proc.err
    assert error_lines(err) == err.strip().splitlines(), err                    # one line, nothing else
    assert len(error_lines(err)) == 1 and "ulimit -f" in err and "nothing was kept" in err
    assert proc.out == ""
    assert_nothing_kept(root)

    assert main(["convert", "--model", str(tiny_pair[0]), "--quant", "none", "--out", str(root), "--no-progress"]) == 0
    assert "(built)" in capsys.readouterr().out
    assert layer_digests(cache_dir(tiny_pair[0], root)) == clean["digests"]


@pytest.fixture(scope="module")
def transcript(tiny_pair, tiny_perturbed_draft, tmp_path_factory) -> str:
    """stdout of a fault-free two-turn chat (answers and prompts) on its own cache root."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    root = tmp_path_factory.mktemp("chat-cache")
    out = io.StringIO()
    stdin = sys.stdin
    try:
        sys.stdin = ScriptedTerminal(TURNS)
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            assert main(chat_argv(tiny_pair, tiny_perturbed_draft, root)) == 0
    finally:
        sys.stdin = stdin
    assert out.getvalue().count(">>> ") == 3
    return out.getvalue()


def run_chat(monkeypatch, argv: list[str], script) -> int:
    monkeypatch.setattr(sys, "stdin", ScriptedTerminal(script))
    return main(argv)


@pytest.mark.timeout(30)
def test_cache_dir_deleted_under_a_running_chat_changes_nothing(
        tiny_pair, tiny_perturbed_draft, transcript, tmp_path, monkeypatch, capsys) -> None:
    """Decided behaviour: the session keeps serving from the file it has open (unlinked files stay readable),
    answers exactly as without the deletion; the next start rebuilds the cache."""
    root = tmp_path / "cache"
    final = cache_dir(tiny_pair[0], root)
    before = pager_threads()
    code = run_chat(monkeypatch, chat_argv(tiny_pair, tiny_perturbed_draft, root),
                    [TURNS[0], lambda: shutil.rmtree(final), *TURNS[1:]])
    out, err = capsys.readouterr()
    assert code == 0 and not final.exists(), err
    assert out == transcript and "error" not in err
    assert pager_threads() <= before                         # the session's pager thread was stopped

    assert run_chat(monkeypatch, chat_argv(tiny_pair, tiny_perturbed_draft, root), TURNS) == 0
    assert capsys.readouterr().out == transcript and final.exists()


@pytest.mark.timeout(30)
def test_layer_file_truncated_under_a_running_chat_ends_it_with_one_line(
        tiny_pair, tiny_perturbed_draft, transcript, tmp_path, monkeypatch, capsys) -> None:
    """Decided behaviour: the next pass cannot read its layers, so the session ends (exit 2) with one line
    naming the file; the pager thread stops; the next start detects the short file and rebuilds it."""
    root = tmp_path / "cache"
    layers = cache_dir(tiny_pair[0], root) / LAYERS_FILE

    def truncate() -> None:
        with open(layers, "r+b") as f:
            f.truncate(4096)

    before = pager_threads()
    code = run_chat(monkeypatch, chat_argv(tiny_pair, tiny_perturbed_draft, root),
                    [TURNS[0], truncate, *TURNS[1:], "never read"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    line = error_lines(err)[0]
    assert str(layers) in line and "truncated" in line and "rebuilds" in line
    first_turn = transcript[:transcript.index(">>> ", 1) + 4]               # the first answer, then the prompt
    assert out.startswith(first_turn) and "never read" not in out
    assert pager_threads() <= before

    assert run_chat(monkeypatch, chat_argv(tiny_pair, tiny_perturbed_draft, root), TURNS) == 0
    out, err = capsys.readouterr()
    assert out == transcript and "rebuilding it" in err


# ------------------------------------------------------------------------------------------ out of memory

@pytest.fixture(scope="module")
def resident(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=4, dtype="float32"))


@pytest.fixture(scope="module")
def streamed(tiny_pair, tiny_perturbed_draft, tmp_path_factory) -> Runtime:
    yield from streamed_runtime(tiny_pair, tiny_perturbed_draft, tmp_path_factory.mktemp("oom-cache"), budget=4)


def oom_in_forward(runtime: Runtime, monkeypatch, error: BaseException) -> None:
    """The target's 3rd forward from now raises `error` (mid-answer: prefill, then two verification passes)."""
    target = runtime.engine.target
    real, calls = type(target).forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real(target, *args, **kwargs)

    monkeypatch.setattr(target, "forward", forward)


def oom_in_reader(runtime: Runtime, monkeypatch, error: BaseException) -> None:
    """The pager's reader thread fails to read a layer once (e.g. a bounce buffer it cannot allocate)."""
    reader = runtime.engine.target.pager.ssd
    real, calls = reader.read_layer, []

    def read_layer(i, out=None, *args, **kwargs):
        calls.append(i)
        if len(calls) == 7:
            raise error
        return real(i, out, *args, **kwargs)

    monkeypatch.setattr(reader, "read_layer", read_layer)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where,error", [
    ("forward", MemoryError()),
    ("forward", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")),
    ("reader", MemoryError()),
], ids=["MemoryError", "cuda-OOM", "MemoryError-in-pager-thread"])
def test_out_of_memory_in_a_step_keeps_the_session(request, monkeypatch, where: str, error: BaseException) -> None:
    runtime = request.getfixturevalue("streamed" if where == "reader" else "resident")
    first, second = "Hello there", "Tell me a story"
    screen = Screen()
    chat = ChatSession(runtime, SamplingParams(), None, screen.console, screen.write, 16)
    runtime.engine.reset()
    assert chat.handle(first) is True
    answer = chat.messages[-1]["content"]
    expected = fresh_answer(runtime, chat.messages, second, 16)      # a clean session with the same history

    (oom_in_reader if where == "reader" else oom_in_forward)(runtime, monkeypatch, error)
    shown = len(screen.out)
    assert chat.handle("What is the capital of France?") is True            # the failing turn
    lines = [ln for ln in screen.err.getvalue().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "out of memory" in lines[0] and "/set budget" in lines[0], screen.err.getvalue()
    assert [m["content"] for m in chat.messages] == [first, answer]          # the failed turn left nothing
    monkeypatch.undo()
    if where == "forward":
        assert len(screen.out) > shown                       # it failed mid-answer, after text was shown

    assert chat.handle(second) is True
    assert chat.messages[-1]["content"] == expected
