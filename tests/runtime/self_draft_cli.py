"""`generate --json` of the tiny target streamed from the SSD tier, against its own --no-draft run: what the
self-draft CLI tests share (tests/runtime/test_self_draft.py, test_depth_probe.py)."""
from __future__ import annotations

import json
from pathlib import Path

from cli.main import main


def self_draft_json(capsys, target: Path, cache_dir: Path, *draft: str) -> tuple[dict, str, list[int]]:
    """Run the target alone, then with `draft` flags (e.g. --draft self --draft-layers 2) -> (the drafted run's
    JSON, its stderr, the target-alone token ids)."""
    common = ["generate", "--model", str(target), "--dtype", "float32", "--max-new-tokens", "12", "--prompt",
              "The quick brown fox", "--json", "--offload", "ssd", "--cache-dir", str(cache_dir)]
    assert main([*common, "--no-draft"]) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*common, *draft]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err, want
