"""An int4 target on a CPU is row-exact end to end: its linears (the integer kernels) and its attention
(cpu_kernels.attend, row by row), so speculative greedy output equals the target alone at any budget.
"""
from __future__ import annotations

import pytest
import torch

from cpu_kernels.build import library, status
from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig
from specexec.decoding.engine import Engine
from tests.runtime.offloaded_models import reference



@pytest.fixture(scope="module")
def int4_target(tiny_pair):
    if library() is None:
        pytest.skip(status())
    model = reference(tiny_pair[0], "int4")
    assert model.execution.row_exact
    return model


@pytest.mark.parametrize("budget", [2, 8, 16, 32])
def test_speculative_greedy_equals_the_int4_target_alone(int4_target, tiny_perturbed_draft, budget: int) -> None:
    draft = load_model(tiny_perturbed_draft)
    prompt = torch.randint(7, 300, (14,), generator=torch.Generator().manual_seed(budget)).tolist()
    alone = [t for s in Engine(int4_target, None, EngineConfig(budget=1), None).generate(prompt, 40) for t in s]
    engine = Engine(int4_target, draft, EngineConfig(budget=budget), SpecExecBuilder())
    assert [t for s in engine.generate(prompt, 40) for t in s] == alone
    assert max(s.tree_size for s in engine.stats.steps) > 1
