"""`specexec chat` on a hybrid model through a pseudo-terminal: three turns, each after the first prefilling
only what the previous turns' attention KV and recurrent states do not hold."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
            "TERM": "dumb", "COLUMNS": "160"}


@pytest.mark.slow
def test_three_turns_reuse_the_state(tiny_qwen3_5: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    draft = write_tiny_model(tiny_qwen3_5.parent / f"{tiny_qwen3_5.name}-draft", perturb=DRAFT_PERTURB,
                             base=tiny_qwen3_5, seed=30)
    child = pexpect.spawn(sys.executable, ["-m", "cli.main", "chat", "--model", str(tiny_qwen3_5), "--draft",
                                           str(draft), "--budget", "8", "--max-new-tokens", "16"],
                          cwd=str(ROOT), env={**os.environ, **TERMINAL}, encoding="utf-8",
                          timeout=240, dimensions=(40, 160))
    reused = []
    try:
        child.expect_exact(">>> ")
        for message in ("Hello there", "Tell me a story", "What is the capital of France?"):
            child.sendline(message)
            child.expect(r"prefill (\d+) tokens \((\d+) reused\)")
            reused.append(int(child.match.group(2)))
            child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1], reused
