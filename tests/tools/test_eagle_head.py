"""tools/train-eagle-head on the tiny pair: it generates the target's greedy answers, trains a head for a few
seconds, saves it in the published EAGLE-3 layout, and what it saved is what it trained (the saved-then-loaded
head's logits equal the trained modules'); the saved head drafts through `--draft eagle3:DIR` with output equal
to the target alone (fp32 greedy)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main as cli
from specexec.drafters.eagle3 import read_config
from tools.eagle_head.__main__ import main

pytestmark = pytest.mark.slow


def test_the_trained_head_is_saved_as_trained_and_drafts_exactly(capsys, tiny_pair, tmp_path: Path) -> None:
    target, draft = tiny_pair
    out = tmp_path / "head"
    assert main(["--target", str(target), "--draft", str(draft), "--out", str(out), "--prompts", "3",
                 "--doc-prompts", "0", "--new-tokens", "8", "--draft-vocab", "48", "--intermediate", "32",
                 "--train-seconds", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["optimizer_steps"] >= 1 and report["saved_vs_trained_max_logit_diff"] < 1e-4
    cfg = read_config(out)
    assert cfg["draft_vocab_size"] == 48 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    common = ["generate", "--model", str(target), "--prompt", "the cat sat", "--max-new-tokens", "12",
              "--dtype", "float32", "--json"]
    assert cli([*common, "--draft", f"eagle3:{out}"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert cli([*common, "--no-draft"]) == 0
    assert drafted["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
