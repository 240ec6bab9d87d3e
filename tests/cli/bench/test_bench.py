"""`specexec bench` (end to end) on the tiny pair: every configuration in one run, the table, the JSON
contract, exactness at T=0, prompt files and truncation, one-line errors; the built-in prompt set; and that
`specexec bench stream` still lives beside it."""
from __future__ import annotations

import json

import pytest

from cli.bench.main import CONFIG_KINDS, hf_available
from cli.main import main
from specexec.options import ConfigError, parse_budget_list
from specexec.prompts import load_prompts, parse_prompts

ROW_KEYS = {"config", "tok_s", "tokens_per_pass", "ttft_s", "identical_to_baseline", "identical_prompts",
            "peak_ram_gb", "peak_vram_gb", "speedup", "new_tokens", "passes"}


def _bench(capsys, pair, *extra: str) -> tuple[dict, str]:
    target, draft = pair
    code = main(["bench", "--model", str(target), "--draft", str(draft), "--dtype", "float32", "--limit", "2",
                 "--max-new-tokens", "8", "--warmup", "1", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured, captured.err


def test_all_rows_table_and_json(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    captured, err = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "4,16", "--json")
    assert captured.out.count("\n") == 1
    obj = json.loads(captured.out)
    configs = [r["config"] for r in obj["rows"]]
    expected = ["specexec budget=4", "specexec budget=16", "no-draft"]
    if hf_available():
        expected += ["hf-offload", "hf-assisted"]
    assert configs == expected
    for row in obj["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["tok_s"] > 0 and row["ttft_s"] > 0 and 0 < row["new_tokens"] <= 16
        assert isinstance(row["identical_to_baseline"], bool)
        assert set(row["speedup"]) == set(expected) - {c for c in expected if c.startswith("specexec")}
    rows = {r["config"]: r for r in obj["rows"]}
    for name in ("specexec budget=4", "specexec budget=16"):
        assert rows[name]["identical_to_baseline"] is True          # fp32 greedy: exactly the target alone
        assert rows[name]["tokens_per_pass"] >= 1
    assert rows["no-draft"]["tokens_per_pass"] == 1.0 and rows["no-draft"]["speedup"]["no-draft"] == 1.0
    if hf_available():
        assert rows["hf-offload"]["tokens_per_pass"] == pytest.approx(1.0)
        assert rows["hf-assisted"]["identical_prompts"].endswith("/2")
    assert obj["prompts"] == 2 and obj["temperature"] == 0.0
    for name in expected:                                           # the table went to stderr
        assert name in err
    assert "tok/s" in err and "identical" in err


def test_table_on_stdout_without_json(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    captured, _ = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "8",
                         "--configs", "specexec,no-draft")
    assert "specexec budget=8" in captured.out and "no-draft" in captured.out and "× no-draft" in captured.out
    assert "hf-offload" not in captured.out


def test_header_names_the_budgets_swept(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    _, err = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "8,32", "--configs",
                    "specexec,no-draft", "--json")
    assert "builder specexec · sweeping 2 prompts over budgets 8, 32, no-draft" in err
    assert "budget 64" not in err


def test_each_configuration_reports_its_prompts(tiny_pair, tiny_perturbed_draft) -> None:
    """run_variant tells the progress its prompts done of all, from 0 to all (a bar with an ETA on stderr)."""
    from cli.bench.common import Plan, run_variant
    from specexec.config import EngineConfig, OffloadConfig, SamplingParams
    from specexec.runtime.assembly import Runtime

    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=4, max_new_tokens=4))
    plan = Plan(rt.config, SamplingParams(), OffloadConfig(), (4,), None, ("specexec",), (), 1)
    heard: list[tuple[str, int, int]] = []

    class Bars:
        def __call__(self, message: str) -> None:
            heard.append((message, -1, -1))

        def prompts(self, name: str, done: int, total: int) -> None:
            heard.append((name, done, total))

    run_variant("x", rt, 4, plan, [rt.encode("a b"), rt.encode("c d"), rt.encode("e")], 0, Bars())
    assert heard == [("x", 0, 3), ("x", 1, 3), ("x", 2, 3), ("x", 3, 3)]


def test_the_warm_up_leaves_an_auto_tuner_its_costs_but_not_its_acceptance(tiny_pair, tiny_perturbed_draft) -> None:
    """A --budget auto row starts its prompts where a fresh run starts (the start budget, the prior's
    acceptance) with the seconds the warm-up measured; before, the warm-up's trees taught the row's first choice."""
    from cli.bench.common import Plan, run_variant
    from specexec.config import EngineConfig, OffloadConfig, SamplingParams
    from specexec.runtime.assembly import Runtime

    cfg = EngineConfig(budget=64, max_new_tokens=8, auto_budget=True)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), cfg)
    tuner = rt.engine.tuner
    start = tuner.budget
    plan = Plan(rt.config, SamplingParams(), OffloadConfig(), ("auto",), None, ("specexec",), (), 1)
    run_variant("auto", rt, "auto", plan, [], 8, lambda _m: None)
    assert tuner.heard > 0 and tuner.costs.draft.points           # the warm-up was heard and timed
    assert float(tuner.acceptance.seen.sum()) == 0.0               # its acceptance is forgotten
    assert tuner.budget == start and tuner.steps == 0 and not tuner.settled


def test_prompt_bars_show_prompts_done_and_time_left() -> None:
    import io

    from rich.console import Console

    from cli.bench.progress import PromptBars

    out = io.StringIO()
    with PromptBars(Console(file=out, force_terminal=True, width=120)) as bars:
        bars("loading the transformers target")
        bars.prompts("specexec budget=8", 1, 4)
        bars.progress.refresh()
        shown = out.getvalue()
        bars.prompts("specexec budget=8", 4, 4)
        assert not bars.bars                                  # a finished configuration's bar goes
    assert "specexec budget=8" in shown and "1/4" in shown and "prompts" in shown and "left" in shown


def test_sampling_rows_have_no_identity_check(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    captured, _ = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "8", "--configs",
                         "specexec,no-draft", "--temperature", "0.8", "--seed", "1", "--json")
    rows = json.loads(captured.out)["rows"]
    assert all(r["identical_to_baseline"] is None for r in rows)


def test_own_prompts_are_left_truncated_with_a_warning(capsys, tmp_path, tiny_pair, tiny_perturbed_draft) -> None:
    prompts = tmp_path / "p.jsonl"
    long_text = "The quick brown fox jumps over the lazy dog. " * 80
    prompts.write_text(json.dumps({"id": "long", "prompt": long_text}) + "\n\n" +
                       json.dumps({"prompt": "Hello", "category": "chat", "system": "Be brief."}) + "\n")
    captured, err = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "8", "--configs",
                           "specexec,no-draft", "--prompts", str(prompts), "--max-new-tokens", "400", "--json")
    assert "prompt long" in err and "left-truncated to 112" in err               # context 512 - 400
    assert json.loads(captured.out)["prompts"] == 2


def test_no_draft_only(capsys, tiny_pair) -> None:
    code = main(["bench", "--model", str(tiny_pair[0]), "--no-draft", "--limit", "1", "--max-new-tokens", "4",
                 "--configs", "no-draft", "--json", "--warmup", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert [r["config"] for r in json.loads(captured.out)["rows"]] == ["no-draft"]


ERRORS = {
    "no model": (["bench", "--no-draft"], "--model"),
    "budget zero": (["--budgets", "16,0"], "budget"),
    "budget word": (["--budgets", "16,many"], "'many'"),
    "unknown config": (["--configs", "specexec,vllm"], "'vllm'"),
    "limit zero": (["--limit", "0"], "--limit"),
    "assisted without draft": (["--no-draft", "--configs", "hf-assisted"], "needs a draft"),
    "hf with frequency penalty": (["--frequency-penalty", "0.5", "--configs", "no-draft,hf-offload"],
                                  "transformers' generate() has no such penalty"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_are_one_line(capsys, tiny_pair, case) -> None:
    extra, needle = ERRORS[case]
    argv = extra if extra[0] == "bench" else ["bench", "--model", str(tiny_pair[0]),
                                               *([] if "--no-draft" in extra else ["--draft", str(tiny_pair[1])]),
                                               *extra]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: ") and needle in err, err


def test_bad_prompt_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="p.jsonl:2: unknown key 'answer'"):
        parse_prompts('{"prompt": "a"}\n{"prompt": "b", "answer": "c"}\n', "p.jsonl")
    with pytest.raises(ConfigError, match="p.jsonl:1 is not a JSON object"):
        parse_prompts("prompt: a\n", "p.jsonl")
    with pytest.raises(ConfigError, match="holds no prompts"):
        parse_prompts("\n\n", "p.jsonl")
    with pytest.raises(ConfigError, match="non-empty string"):
        parse_prompts('{"prompt": ""}', "p.jsonl")
    with pytest.raises(ConfigError, match="cannot read --prompts"):
        load_prompts(tmp_path / "missing.jsonl")


def test_builtin_prompt_set() -> None:
    prompts = load_prompts()
    assert len(prompts) == 40 and len({p.id for p in prompts}) == 40
    cats = [p.category for p in prompts]
    assert {c: cats.count(c) for c in set(cats)} == {"chat": 10, "code": 10, "reasoning": 10, "summarisation": 10}


def test_budget_lists() -> None:
    assert parse_budget_list("16, 64,256,64", auto_supported=False) == (16, 64, 256)
    assert parse_budget_list("16,auto", auto_supported=True) == (16, "auto")
    with pytest.raises(ConfigError, match="budget tuner"):
        parse_budget_list("auto", auto_supported=False)
    assert set(CONFIG_KINDS) == {"specexec", "no-draft", "hf-offload", "hf-assisted", "llama.cpp"}


def test_stream_bench_still_has_its_subcommand(capsys) -> None:
    assert main(["bench", "stream", "--help"]) == 0
    assert "--synthetic" in capsys.readouterr().out
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--budgets" in out and "stream" in out


def test_repeat_keeps_each_configurations_fastest_round(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    captured, err = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "4", "--configs",
                           "specexec,no-draft", "--repeat", "2", "--json")
    rows = json.loads(captured.out)["rows"]
    assert [r["config"] for r in rows] == ["specexec budget=4", "no-draft"]
    done = [line for line in err.splitlines() if line.startswith("done ")]     # one line per finished configuration
    assert sum("(round 2/2)" in line for line in done) == 2 and rows[0]["identical_to_baseline"] is True


def test_auto_row_reports_the_budget_per_step(capsys, tmp_path, monkeypatch, tiny_pair, tiny_perturbed_draft) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    captured, err = _bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--budgets", "8,auto", "--max-budget", "32",
                           "--configs", "specexec,no-draft", "--json")
    rows = {r["config"]: r for r in json.loads(captured.out)["rows"]}
    auto = rows["specexec budget=auto"]
    assert auto["identical_to_baseline"] is True and auto["budget_trace"]
    assert rows["specexec budget=8"]["budget_trace"] is None
    steps = sum(int(p.split("×")[1]) if "×" in p else 1 for p in auto["budget_trace"].removeprefix("… ").split())
    assert steps <= auto["passes"]
    assert f"specexec budget=auto: budget per step {auto['budget_trace']}" in err
