"""--experts: the planner's choice between streaming a sparse layer's experts and computing them on the CPU
(specexec/planning/expert_place.py), `specexec plan`'s line, and bad values."""
from __future__ import annotations

import json

import pytest

from cli.main import main
from specexec.config import OffloadConfig
from specexec.options import ConfigError

GPT_OSS = "specexec/checkpoints/configs/gpt-oss-120b"


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--model", GPT_OSS, "--gpu-memory", "24GB", "--ram-budget", "128GB", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_auto_follows_the_costs(capsys) -> None:
    """A one-row pass costs the CPU top_k products, streaming the same experts over a slower link: CPU. A
    17-row tree costs the CPU 17 x top_k products against the union streamed: stream (at an equal rate)."""
    one = plan_json(capsys, "--experts", "auto", "--budget", "1", "--cpu-gbps", "60", "--link-gbps", "25")["experts"]
    assert one["cpu_layers"] and len(one["cpu_layers"]) == one["eligible"]
    assert one["cpu_s_per_layer"] < one["stream_s_per_layer"]
    tree = plan_json(capsys, "--experts", "auto", "--budget", "16", "--cpu-gbps", "25", "--link-gbps", "25")["experts"]
    assert tree["cpu_layers"] == [] and tree["cpu_s_per_layer"] > tree["stream_s_per_layer"]


def test_cpu_n_takes_the_last_n_eligible_layers(capsys) -> None:
    every = plan_json(capsys, "--experts", "cpu")["experts"]
    last = plan_json(capsys, "--experts", "cpu:4")["experts"]
    assert len(every["cpu_layers"]) == every["eligible"] > 4
    assert last["cpu_layers"] == every["cpu_layers"][-4:]


def test_plan_prints_the_choice_and_why(capsys) -> None:
    assert main(["plan", "--model", GPT_OSS, "--gpu-memory", "24GB", "--ram-budget", "128GB", "--experts", "cpu:8",
                 "--budget", "16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("experts:"))
    assert "cpu for 8 of 36 sparse layers" in line and "s CPU vs" in line and "s streamed" in line


@pytest.mark.parametrize("bad", ["gpu", "cpu:0", "cpu:x", "auto:2"])
def test_a_bad_value_is_one_line(bad: str, capsys) -> None:
    with pytest.raises(ConfigError, match="--experts"):
        OffloadConfig.from_flags(experts=bad)
    assert main(["plan", "--model", GPT_OSS, "--gpu-memory", "24GB", "--experts", bad]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experts" in err[0] and "Traceback" not in err[0]
