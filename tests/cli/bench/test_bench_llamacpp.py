"""The llama.cpp rows of `specexec bench` (cli/bench/llamacpp.py): skipped with one line when llama-cpp-python is
absent or no GGUF is named; with a stand-in for the package, the plumbing: our prompt ids, max tokens, greedy
sampling and thread count reach it, both rows (plain and prompt-lookup) come back with tok/s and TTFT, never
called identical, and the table gains a × llama.cpp column. The real package is never needed."""
from __future__ import annotations

import json
import pytest
import torch

from cli.bench import llamacpp
from cli.main import main


FAKE = '''"""A stand-in for llama_cpp (written by the test): records each call as a JSON line in $FAKE_LLAMA_LOG."""
import json, os, signal


def _log(entry):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class Llama:
    def __init__(self, **kw):
        _log({"init": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}})

    def reset(self):
        pass

    def generate(self, tokens, **kw):
        _log({"tokens": list(tokens), **kw})
        if os.environ.get("FAKE_LLAMA_CRASH") == "generate" and len(tokens) > 8:    # not the warm-up
            os.kill(os.getpid(), signal.SIGSEGV)
        while True:                                   # a stream the caller stops at max tokens
            yield 7
'''
SPECULATIVE = """def LlamaPromptLookupDecoding(num_pred_tokens):
    return ("lookup", num_pred_tokens)
"""


class FakeCalls:
    """What the stand-in package recorded (it runs in the rows' child process, so it writes to a file)."""

    def __init__(self, log) -> None:
        self.log = log

    @property
    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch, tmp_path) -> FakeCalls:
    """A llama_cpp package on disk, first on sys.path (the spawned child inherits the path and environment)."""
    pkg = tmp_path / "fakes" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE)
    (pkg / "llama_speculative.py").write_text(SPECULATIVE)
    monkeypatch.syspath_prepend(str(tmp_path / "fakes"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakes"))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    return FakeCalls(tmp_path / "calls.jsonl")


def _bench(capsys, model, *extra: str) -> tuple[dict, str]:
    code = main(["bench", "--model", str(model), "--no-draft", "--limit", "2", "--max-new-tokens", "5",
                 "--warmup", "0", "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def test_without_the_package_the_rows_are_skipped_with_one_line(capsys, monkeypatch, tiny_pair, tmp_path) -> None:
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    out, err = _bench(capsys, tiny_pair[0], "--configs", "no-draft,llama.cpp", "--gguf", str(gguf))
    assert [r["config"] for r in out["rows"]] == ["no-draft"]
    lines = [line for line in err.splitlines() if "llama.cpp" in line]
    assert len(lines) == 1 and "llama-cpp-python is not installed" in lines[0] and "pip install" in lines[0]
    _, err = _bench(capsys, tiny_pair[0], "--configs", "no-draft")           # not asked for: not a word
    assert "llama.cpp" not in err


def test_without_a_gguf_the_rows_are_skipped_with_one_line(capsys, fake_llama_cpp, tiny_pair) -> None:
    out, err = _bench(capsys, tiny_pair[0], "--configs", "no-draft,llama.cpp")
    assert [r["config"] for r in out["rows"]] == ["no-draft"] and fake_llama_cpp.calls == []
    assert "llama.cpp rows skipped: no GGUF file; pass --gguf PATH" in err


@pytest.mark.slow          # a whole bench run over the tiny pair (~25 s on 2 busy cores)
def test_the_rows_get_our_prompts_tokens_and_threads(capsys, fake_llama_cpp, tiny_pair, tmp_path) -> None:
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    out, err = _bench(capsys, tiny_pair[0], "--configs", "no-draft,llama.cpp", "--gguf", str(gguf))
    rows = {r["config"]: r for r in out["rows"]}
    assert list(rows) == ["no-draft", "llama.cpp", "llama.cpp prompt-lookup"]
    inits = [c["init"] for c in fake_llama_cpp.calls if "init" in c]
    assert [i["model_path"] for i in inits] == [str(gguf)] * 2
    assert all(i["n_threads"] == torch.get_num_threads() for i in inits)
    assert inits[0]["draft_model"] is None and inits[1]["draft_model"] == ["lookup", llamacpp.LOOKUP_TOKENS]
    gens = [c for c in fake_llama_cpp.calls if "tokens" in c]
    assert len(gens) == 4 and all(g["temp"] == 0.0 and g["top_k"] == 1 for g in gens)      # greedy, 2 prompts each
    assert gens[0]["tokens"] == gens[2]["tokens"] and gens[1]["tokens"] == gens[3]["tokens"]
    for name in ("llama.cpp", "llama.cpp prompt-lookup"):
        r = rows[name]
        assert r["new_tokens"] == 10 and r["tok_s"] > 0 and r["ttft_s"] is not None
        assert r["identical_to_baseline"] is None and r["first_mismatch"] is None and r["draft_ms_per_step"] is None
    assert rows["llama.cpp"]["tokens_per_pass"] == 1.0 and rows["llama.cpp prompt-lookup"]["tokens_per_pass"] is None
    assert "llama.cpp" in rows["no-draft"]["speedup"] and "× llama.cpp" in err


def test_a_gguf_model_is_its_own_gguf(tmp_path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert llamacpp.gguf_for(str(g), None) == g and llamacpp.gguf_for(str(tmp_path), None) is None
    assert llamacpp.gguf_for(str(g), "/x/other.gguf").name == "other.gguf"


def test_a_crash_inside_llama_cpp_costs_its_rows_not_the_bench(capsys, fake_llama_cpp, tiny_pair, tmp_path,
                                                              monkeypatch) -> None:
    """llama.cpp is native code built on the user's machine: a segfault there (a build for instructions the CPU
    lacks) ends its child process only; the bench prints its table with our rows and one line saying what died."""
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "generate")
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    out, err = _bench(capsys, tiny_pair[0], "--configs", "no-draft,llama.cpp", "--gguf", str(gguf))
    assert [r["config"] for r in out["rows"]] == ["no-draft"] and out["rows"][0]["new_tokens"] > 0
    lines = [line for line in err.splitlines() if "llama.cpp rows stopped" in line]
    assert len(lines) == 1 and "SIGSEGV" in lines[0] and "GGML_NATIVE=OFF" in lines[0]
