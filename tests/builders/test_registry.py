"""One registry per concept: builder names (specexec/builders/registry.py), verifier rules (verify.RULES), layer
formats (offload.quant.FORMATS), offload modes and KV placements (offload.memory_plan), KV quantization
(specexec.options.KV_QUANTS). Adding a name to its registry is all it takes for the flags' --help text, config
validation and error messages to know it (options.choices reads them; builder and verifier names are checked
where their registries are used, so building an EngineConfig imports neither torch nor a builder), and no other
module lists the names."""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.bench.builders import parse_builders
from cli.main import build_parser
from offload import memory_plan
from offload import quant
from offload.quant import weights
from specexec import options
from specexec.acceptance import rules as verify
from specexec.builders import registry
from specexec.config import EngineConfig, OffloadConfig
from specexec.options import ConfigError, choices
from specexec.checkpoints import loading

ROOT = Path(__file__).resolve().parents[2]


def help_text(capsys: pytest.CaptureFixture, *command: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help-all"])
    return " ".join(capsys.readouterr().out.split())                   # argparse's wrapping undone


@dataclass
class ProbeBuilder:
    """A builder that exists only in this test."""
    name: str = "zzprobe"
    drafting: str = "deterministic"
    needs_draft: bool = False

    def build(self, draft, root_token, budget, sampling, rng=None):
        raise NotImplementedError

    def observe(self, tree, accepted_nodes, bonus) -> None:
        pass

    def kv_slots(self, budget: int) -> int:
        return budget


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder registry, loaded, as a copy this test may add to."""
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry.factories()))


def test_a_registered_builder_reaches_validation_help_errors_and_bench(fresh_registry, capsys) -> None:
    assert "zzprobe" not in registry.names()
    with pytest.raises(ConfigError, match="unknown builder 'zzprobe'"):
        registry.check_builder("zzprobe")
    registry.register(ProbeBuilder)
    assert "zzprobe" in registry.names() and EngineConfig(builder="zzprobe").builder == "zzprobe"
    assert isinstance(registry.make_builder("zzprobe"), ProbeBuilder) and not registry.builder_needs_draft("zzprobe")
    with pytest.raises(ConfigError, match="zzprobe"):                   # the error lists the registered names
        registry.make_builder("nope")
    for command in (("generate",), ("chat",), ("plan",), ("bench", "builders")):
        assert "zzprobe" in help_text(capsys, *command), command
    assert "zzprobe" in parse_builders(None, has_draft=False)
    registry._FACTORIES.pop("zzprobe")                                   # nothing kept a copy of the names
    with pytest.raises(ConfigError, match="unknown builder"):
        registry.check_builder("zzprobe")


def test_building_an_engine_config_imports_neither_torch_nor_a_builder() -> None:
    """Builder and verifier names are checked where their registries are used (make_builder, the Engine,
    Runtime.load), so a config, e.g. one a server builds per request, costs no import."""
    code = ("import sys; from specexec.config import EngineConfig; EngineConfig(builder='chain', verifier='rrs'); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('specexec.builders')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys; from specexec.builders.registry import names; names(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"                        # the check above can tell the difference


def test_an_unknown_builder_or_verifier_fails_before_anything_loads(tmp_path: Path) -> None:
    from specexec.runtime.assembly import Runtime

    missing = str(tmp_path / "no-such-model")                 # reached only after the names are checked
    with pytest.raises(ConfigError, match="unknown builder 'nope'"):
        Runtime.load(missing, None, EngineConfig(builder="nope"))
    with pytest.raises(ConfigError, match="unknown verifier 'nope'"):
        Runtime.load(missing, None, EngineConfig(verifier="nope"))
    with pytest.raises(ConfigError, match="builder must be a name"):
        EngineConfig(builder=3)


def test_register_refuses_a_second_class_under_a_taken_name_or_no_name(fresh_registry) -> None:
    @dataclass
    class Impostor(ProbeBuilder):
        name: str = "chain"

    with pytest.raises(ValueError, match="registered twice"):
        registry.register(Impostor)
    with pytest.raises(TypeError, match="name"):
        registry.register(type("Nameless", (), {}))
    assert registry.register(registry.factories()["chain"]) is registry.factories()["chain"]   # idempotent


def test_every_builder_class_in_the_package_registered_itself() -> None:
    found = {}                                  # class -> its `name = "..."` default: what a builder looks like
    for module in sorted((ROOT / "specexec" / "builders").glob("*.py")):
        for node in ast.parse(module.read_text(encoding="utf-8")).body:
            for item in node.body if isinstance(node, ast.ClassDef) else ():
                if (isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "name"
                        and isinstance(item.value, ast.Constant)):
                    found[node.name] = item.value.value
    assert {cls.__name__: name for name, cls in registry.factories().items()} == found
    assert set(registry.names()) >= {"specexec", "chain", "static", "dynamic", "optree", "rsd", "rsd-c",
                                     "recycling"}
    assert list(registry.names()) == sorted(registry.names())           # an order that is not import order


def test_a_registered_verifier_reaches_validation_and_help(monkeypatch, capsys) -> None:
    assert verify.verifier_names() == ("auto", *verify.RULES)
    with pytest.raises(ConfigError, match="unknown verifier 'zzrule'"):
        verify.check_verifier("zzrule")
    monkeypatch.setitem(verify.RULES, "zzrule", verify.Rule("zzrule", verify.accept_greedy, "probe", "argmax"))
    verify.check_verifier("zzrule")
    assert "zzrule" in help_text(capsys, "generate")
    with pytest.raises(ConfigError, match="zzrule"):                    # the error lists the registered rules
        verify.check_verifier("nope")


def test_offload_registries_reach_validation_help_and_errors(monkeypatch, capsys) -> None:
    assert choices("--quant") == ("auto", *weights.FORMATS) and choices("--draft-quant") == tuple(weights.FORMATS)
    assert choices("--offload") == memory_plan.OFFLOAD_MODES and choices("--kv-offload") == memory_plan.COMPANION_MODES
    assert choices("--kv-quant") == options.KV_QUANTS
    monkeypatch.setattr(quant, "FORMATS", (*quant.FORMATS, "zzfmt"))        # the names' owner (torch-free)
    monkeypatch.setattr(weights, "FORMATS", quant.FORMATS)                  # and its re-export, as read there
    monkeypatch.setattr(memory_plan, "OFFLOAD_MODES", (*memory_plan.OFFLOAD_MODES, "zzmode"))
    monkeypatch.setattr(memory_plan, "COMPANION_MODES", (*memory_plan.COMPANION_MODES, "zzplace"))
    monkeypatch.setattr(options, "KV_QUANTS", (*options.KV_QUANTS, "zzkv"))
    cfg = OffloadConfig(quant="zzfmt", draft_quant="zzfmt", offload="zzmode", kv_offload="zzplace")
    assert (cfg.quant, cfg.offload, cfg.kv_offload) == ("zzfmt", "zzmode", "zzplace")
    assert EngineConfig(kv_quant="zzkv").kv_quant == "zzkv"
    for command in (("generate",), ("plan",)):
        text = help_text(capsys, *command)
        assert all(name in text for name in ("zzfmt", "zzmode", "zzplace", "zzkv")), command
    with pytest.raises(ConfigError, match="zzfmt"):
        OffloadConfig(quant="q3")


def test_dtype_names_live_in_options_and_loading_maps_each_to_torch() -> None:
    assert set(loading.DTYPES) == set(options.DTYPES) - {"auto"} and choices("--dtype") == options.DTYPES


@functools.cache
def _name_lists(path: Path) -> tuple[tuple[int, frozenset[str]], ...]:
    """(line, names) for every literal tuple/list/set of strings, and every dict's string keys, in a module
    (parsed once per session: each registry's case reads every module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and elts:
            strings = frozenset(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            out.append((node.lineno, strings))
    return tuple(out)


def _registries() -> list[tuple[str, set[str], str | None]]:
    return [("builders", set(registry.names()), None),       # each builder names itself, in its own module
            ("verify.RULES", set(verify.RULES), "specexec/acceptance/rules.py"),
            ("quant FORMATS", set(weights.FORMATS), "offload/quant/__init__.py"),
            ("OFFLOAD_MODES", set(memory_plan.OFFLOAD_MODES), "offload/memory_plan.py"),
            ("COMPANION_MODES", set(memory_plan.COMPANION_MODES), "offload/memory_plan.py"),
            ("DTYPES", set(options.DTYPES), "specexec/options.py")]


@pytest.mark.parametrize("which", range(len(_registries())))
def test_no_module_but_the_owner_lists_a_registrys_names_again(which: int) -> None:
    label, names, owner = _registries()[which]
    least = 2 if label == "builders" else len(names)          # builder names are distinctive: two are a list
    bad = [f"{path.relative_to(ROOT)}:{line}" for top in ("specexec", "cli", "offload")
           for path in sorted((ROOT / top).rglob("*.py")) if str(path.relative_to(ROOT)) != owner
           for line, strings in _name_lists(path) if len(strings & names) >= least]
    assert not bad, f"the names of {label} are listed again (read them from the registry instead): {bad}"
