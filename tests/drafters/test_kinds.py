"""The drafter kinds' registry (specexec/drafters/registry.py): --draft parsed once into a DraftSpec, each kind
one row; a new kind is one module + one row. A stub kind ("stub:PATH", an EAGLE-3 layout under another name)
added as a row is parsed, planned from config.json alone, checked once against the headers and loaded through
the registry, and drafts the target's own greedy output; the layout a choice carries is what loading reads
(the headers are read once).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from specexec.checkpoints.loading import read_args
from specexec.config import EngineConfig
from specexec.drafters import eagle3, registry
from specexec.drafters.choose import choose
from specexec.drafters.registry import MODEL, SELF, DrafterKind, parse_draft
from specexec.network.drafter import Eagle3Drafter
from specexec.options import ConfigError
from specexec.runtime.assembly import Runtime
from tests.drafters.drafter_writer import write_eagle3
from tests.tiny_models import prompt


def test_draft_values_parse_once_into_their_kinds(tmp_path) -> None:
    assert parse_draft(None) is None
    assert (parse_draft("self:int8").kind, parse_draft("self").kind) == (SELF, SELF)
    assert (parse_draft("mtp").kind, parse_draft("mtp").where) == ("mtp", "")
    assert (parse_draft("eagle3:org/head").kind, parse_draft("eagle3:org/head").where) == ("eagle3", "org/head")
    assert parse_draft(str(tmp_path)).kind == MODEL and parse_draft(str(tmp_path)).drafter is None
    for bad, said in (("mtp:x", "write --draft mtp alone"), ("eagle3:", "name the head's checkpoint")):
        with pytest.raises(ConfigError, match=said):
            parse_draft(bad)


def test_a_kind_written_by_path_must_say_how_it_is_recognised() -> None:
    with pytest.raises(ValueError, match="recognises"):
        DrafterKind("x", "PATH", Eagle3Drafter, eagle3.checked, eagle3.planned)


def test_a_stub_kind_is_one_row(monkeypatch, tiny_pair, tmp_path) -> None:
    """The stub kind's module is the three functions below (its layout is EAGLE-3's); its row is all else."""
    head = write_eagle3(tmp_path / "head")
    calls = {"checked": 0, "headers": 0}
    read = eagle3.tensor_specs

    def checked(where: str, t_path: Path, t_args, allow_pickle: bool = False):
        calls["checked"] += 1
        return eagle3.checked(where, t_path, t_args, allow_pickle)

    def headers(source):
        calls["headers"] += 1
        return read(source)

    monkeypatch.setattr(eagle3, "tensor_specs", headers)
    monkeypatch.setattr(registry, "KINDS", registry.KINDS + (
        DrafterKind("stub", "NAME:PATH", Eagle3Drafter, checked, eagle3.planned),))
    spec = parse_draft(f"stub:{head}")
    assert spec.kind == "stub" and spec.drafter.network is Eagle3Drafter
    target = tiny_pair[0]
    t_args = read_args(target)
    planned = choose(spec, target, t_args, headers=False)
    assert planned.kind == "stub" and planned.size().kind == "stub" and planned.size().taps == 3
    assert calls == {"checked": 0, "headers": 0}                      # a plan reads config.json alone
    config = EngineConfig(budget=8, dtype="float32")
    rt = Runtime.load(str(target), f"stub:{head}", config)
    try:
        assert calls == {"checked": 1, "headers": 1}                  # checked once, headers read once
        assert isinstance(rt.engine.draft, Eagle3Drafter) and "(stub)" in rt.draft_info.dtype
        alone = rt.variant(config, use_draft=False)
        for ids in (prompt(8, 3), prompt(7)):
            assert [t for s in rt.generate_ids(ids, 16) for t in s] == [t for s in alone.generate_ids(ids, 16)
                                                                         for t in s]
    finally:
        rt.engine.close()


def test_chat_s_default_draft_is_a_kind_the_target_carries(monkeypatch, tiny_pair) -> None:
    """A kind offered by the target's own checkpoint (its row's `offered`) is chat's default draft; none: self."""
    from cli import args as cli_args

    class Config:
        builder = "specexec"
    ns = type("A", (), {"draft": None, "no_draft": False, "model": str(tiny_pair[0])})()
    assert cli_args.check_draft(ns, Config(), default_self=True) and ns.draft == "self"
    monkeypatch.setattr(registry, "KINDS", (DrafterKind("stub", "NAME", Eagle3Drafter, eagle3.checked,
                                                        eagle3.planned, offered=lambda model: True),)
                        + registry.KINDS)
    ns.draft = None
    assert cli_args.check_draft(ns, Config(), default_self=True) and ns.draft == "stub"
