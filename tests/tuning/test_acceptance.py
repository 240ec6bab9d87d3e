"""specexec/tuning/acceptance.py: the positional acceptance vector, counted the way the static builder drafts and
is verified (top-k + argmax at T = 0; draws without replacement + V5 at T > 0), and its cache file."""
from __future__ import annotations

import json
import math

import pytest
import torch

from specexec.options import ConfigError
from specexec.tuning import acceptance
from specexec.builders.static import StaticBuilder
from specexec.config import SamplingParams
from specexec.checkpoints.loading import load_model


def _log(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).log()


def test_greedy_counts_the_rank_of_the_targets_argmax_among_the_drafts() -> None:
    logq = _log([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    logp = _log([[0.9, 0.05, 0.05], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.1, 0.1, 0.8]])
    assert acceptance.greedy_rank_counts(logp, logq, k=2).tolist() == [2.0, 1.0, 1.0]   # ranks 1, 2, 1, none


def test_sampled_counts_match_recursive_rejection_sampling_analytically() -> None:
    # p = (0.5, 0.5), q = (0.9, 0.1): the first draw is accepted with prob 0.9 * 5/9 + 0.1 = 0.6; when it is
    # rejected (it was token 0) the residual is all on token 1, which is the second draw: p_2 = 0.4.
    logp, logq = _log([[0.5, 0.5]] * 50), _log([[0.9, 0.1]] * 50)
    counts = acceptance.sampled_rank_counts(logp, logq, k=2, draws=40, generator=torch.Generator().manual_seed(0))
    share = (counts / counts.sum()).tolist()
    assert counts[2] == 0                                          # two draws exhaust a 2-token vocabulary
    assert share[0] == pytest.approx(0.6, abs=0.035) and share[1] == pytest.approx(0.4, abs=0.035)


def test_identical_models_accept_the_first_child_always(tiny_pair) -> None:
    model = load_model(tiny_pair[0])
    seqs = [([1, 30, 31, 32, 33, 34, 35, 36, 37], 4)]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        vec, n = acceptance.measure(model, model, seqs, sampling, k=4, draws=3,
                                    generator=torch.Generator().manual_seed(1))
        assert n == 5 and vec[0] == pytest.approx(1.0) and sum(vec[1:]) == pytest.approx(0.0)


def test_save_keeps_other_temperatures_and_static_picks_the_nearest(tmp_path) -> None:
    path = tmp_path / "pair.json"
    acceptance.save(path, 0.0, [0.7, 0.1], positions=10)
    acceptance.save(path, 0.6, [0.5, 0.2, 0.1])
    acceptance.save(path, 0.0, [0.8, 0.1])                         # replaces T=0 only
    table = acceptance.load_table(path)
    assert table == {0.0: (0.8, 0.1), 0.6: (0.5, 0.2, 0.1)}
    b = StaticBuilder(acceptance_file=str(path))
    assert b.vector_for(0.0) == (0.8, 0.1)
    assert b.vector_for(0.35) == (0.5, 0.2, 0.1) and b.vector_for(2) == (0.5, 0.2, 0.1)
    assert b.shape_for(6, 0.0).size == 6
    assert b.vector_for(None) == (0.8, 0.1)                         # no temperature: the lowest measured


def test_a_damaged_cache_file_is_read_as_absent_or_refused(tmp_path) -> None:
    path = tmp_path / "pair.json"
    path.write_text("{not json")
    assert acceptance.read(path) is None
    acceptance.save(path, 0.6, [0.5])                              # a damaged file is replaced, not trusted
    assert acceptance.load_table(path) == {0.6: (0.5,)}
    path.write_text('{"vectors": {"0": {"acceptance": [0.9, 0.9]}}}')
    with pytest.raises(ConfigError, match="summing to at most 1"):
        StaticBuilder(acceptance_file=str(path))


def test_expected_tokens_grow_with_the_budget() -> None:
    from cli.bench.accept import expected_tokens

    vec = [0.6, 0.15, 0.05]
    assert expected_tokens(vec, 1) == pytest.approx(1.6)
    assert expected_tokens(vec, 4) > expected_tokens(vec, 2) > expected_tokens(vec, 1)
    assert expected_tokens(vec, 1000) < 1 / (1 - sum(vec)) + 1e-6 + math.inf


@pytest.mark.parametrize("content", ["[0.7, 0.1]", '{"acceptance": [0.7, 0.1]}', '{"vectors": {}}', "{not json"])
def test_anything_but_the_one_file_format_is_refused_in_one_line(tmp_path, content: str) -> None:
    path = tmp_path / "acc.json"                    # bare vectors (the old single-vector format) included
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        StaticBuilder(acceptance_file=str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_the_format_round_trips_with_metadata_and_temperatures_as_keys(tmp_path) -> None:
    path = tmp_path / "acc.json"
    acceptance.save(path, 0.6, [0.7, 0.1, 0.05], pair="tiny", positions=12)
    data = json.loads(path.read_text())
    assert data == {"vectors": {"0.6": {"acceptance": [0.7, 0.1, 0.05], "pair": "tiny", "positions": 12}}}
    assert acceptance.load_table(path) == {0.6: (0.7, 0.1, 0.05)} == {0.6: tuple(acceptance.read(path)["vectors"]
                                                                                   ["0.6"]["acceptance"])}
