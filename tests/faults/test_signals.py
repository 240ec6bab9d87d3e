"""SIGINT and SIGTERM landing in a chosen phase of a real `specexec` process (tests/faults/phase_hooks.py
sends the signal from inside the phase, so where it lands is deterministic, not a matter of timing; the processes
are forked by its fork server, the chat with a pseudo-terminal as its terminal; tests/cli/test_chat.py drives an
exec'd `specexec chat` through pexpect with a terminal Ctrl-C).

- chat, in a pseudo-terminal, target streamed from the SSD tier: Ctrl-C during prefill, drafting and
  verification (mid-pass, while the pager streams layers) cuts the answer (what was shown is a prefix of the
  full answer) and the session goes on; the next answer equals a fresh session's answer to the same history
  (the KV caches stayed consistent). SIGTERM mid-answer ends the process with 143, no traceback.
- convert, while layers.bin is being written: SIGINT exits 130, SIGTERM 143; either way no cache dir and no
  temporary dir is left, the lock is free, and a rerun builds the same bytes as an undisturbed build.
"""
from __future__ import annotations

import fcntl
import io
import json
import os
import struct
import termios
from pathlib import Path

import pytest

from cli.main import main
from specexec.config import EngineConfig
from specexec.runtime.assembly import Runtime
from tests.faults.faults_helpers import (cache_dir, entries, fork_cli, fresh_answer, layer_digests,
                                              lock_is_free, ssd)

MAX_NEW = 24
CONVERT = ("convert", "--quant", "none", "--no-progress")


@pytest.fixture(scope="module")
def streamed(tiny_pair, tiny_perturbed_draft, tmp_path_factory) -> tuple[Runtime, Path]:
    """The chat's runtime in this process (same flags, same cache root, which it builds): the reference."""
    root = tmp_path_factory.mktemp("signals-cache")
    runtime = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=4, dtype="float32"),
                           offload=ssd(root))
    yield runtime, root
    runtime.engine.close()


@pytest.fixture(scope="module")
def interrupted_writers(tiny_pair, tmp_path_factory) -> dict:
    """`convert` processes that get SIGINT / SIGTERM before writing their 2nd layer; started with the module's
    first test, so they run alongside it."""
    where = tmp_path_factory.mktemp("interrupted-writers")
    procs = {sig: (fork_cli([*CONVERT, "--model", str(tiny_pair[0]), "--out", str(where / sig)],
                            where / f"{sig}-proc", hook=f"write@2:{sig}"), where / sig) for sig in ("INT", "TERM")}
    yield procs
    for proc, _ in procs.values():
        proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_in_each_phase_of_a_chat_keeps_the_session_exact(tiny_pair, tiny_perturbed_draft, streamed,
                                                               interrupted_writers, tmp_path) -> None:
    fdpexpect = pytest.importorskip("pexpect.fdpexpect")
    runtime, root = streamed
    argv = ["chat", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--budget", "4",
            "--max-new-tokens", str(MAX_NEW), "--offload", "ssd", "--quant", "none", "--cache-dir", str(root)]
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    proc = fork_cli(argv, tmp_path / "chat", tty=os.ttyname(slave))
    log = io.StringIO()
    child = fdpexpect.fdspawn(master, encoding="utf-8", timeout=40)
    child.logfile_read = log
    phases = ("prefill@1", "draft@3", "verify@3")
    try:
        child.expect_exact(">>> ")
        for k, where in enumerate(phases):
            child.sendline(f"!hook {where}:INT Once upon a time {k}")
            cut = child.expect_exact(["[interrupted: the answer so far stays in the history]", "tokens/pass"])
            assert cut == 0, f"the answer ended before the {where} hook fired: {child.before}"
            child.expect_exact(">>> ")
            child.sendline(f"Go on {k}")
            child.expect_exact("tokens/pass")
            child.expect_exact(">>> ")
            child.sendline(f"/save {tmp_path / f'{k}.json'}")
            child.expect_exact("saved")
            child.expect_exact(">>> ")
        child.sendline("!hook verify@2:TERM The end")
        child.expect_exact("terminated")
        code = proc.wait()
    finally:
        proc.kill()
        os.close(slave)
        os.close(master)
    output = log.getvalue()
    assert code == 143, output
    assert "Traceback" not in output and "error:" not in output

    for k, where in enumerate(phases):
        messages = json.loads((tmp_path / f"{k}.json").read_text())["messages"]
        cut, follow = messages[-4:-2], messages[-2:]
        full = fresh_answer(runtime, messages[:-4], cut[0]["content"], MAX_NEW)
        shown = cut[1]["content"]
        assert full.startswith(shown) and len(shown) < len(full), (where, shown, full)
        if where.startswith("prefill"):
            assert shown == ""                               # nothing was generated yet
        else:
            assert shown                                     # two steps' text was shown before the 3rd step
        assert fresh_answer(runtime, messages[:-2], follow[0]["content"], MAX_NEW) == follow[1]["content"], where


@pytest.mark.timeout(120)
def test_signal_while_writing_the_cache_leaves_it_complete_or_absent(tiny_pair, streamed, interrupted_writers,
                                                                     capsys) -> None:
    _, reference = streamed
    for sig, (proc, root) in interrupted_writers.items():
        code, out, err = proc.wait(), proc.out, proc.err
        assert code == {"INT": 130, "TERM": 143}[sig], (sig, err)
        assert err.strip().splitlines()[-1] == {"INT": "interrupted", "TERM": "terminated"}[sig], err
        assert "Traceback" not in err and out == ""
        seen = entries(root)
        # no cache; the interrupted build's directory is kept for the next build to resume (one layer written)
        assert seen["final"] == [] and seen["temp"] == [f".{seen['lock'][0][:-5]}.tmp-{proc.pid}"], (sig, seen)
        assert len(seen["lock"]) == 1 and lock_is_free(root / ".locks" / seen["lock"][0])

        assert main([*CONVERT, "--model", str(tiny_pair[0]), "--out", str(root)]) == 0      # a rerun resumes
        out, err = capsys.readouterr()
        assert "(built)" in out and "resuming an interrupted build: 1 of 4 layers already converted" in err, err
        assert entries(root)["temp"] == []
        assert layer_digests(cache_dir(tiny_pair[0], root)) == layer_digests(cache_dir(tiny_pair[0], reference))
