"""models.yaml: the catalogue of known models with their recommended drafts, and model name -> local directory.

An entry's drafts name other entries, or `self` / `self:FORMAT`: the target drafting with its own layers
(`drafts: self` alone is a one-item list). An entry with `local: DIR` exists only on this machine (no Hub id):
`demo` and `demo-draft`, the pair `specexec demo` builds, are two such entries every catalogue has.

The catalogue is one YAML file, specexec/checkpoints/models.yaml, shipped in the package ($SPECEXEC_MODELS_YAML
points at another file). Each entry becomes a frozen `ModelEntry`; unknown keys,
wrong types, unknown families or quantizations and drafts that name no entry raise ConfigError naming the file,
the entry and the value. A name is present locally when its checkpoint is in huggingface_hub's local cache
or in a directory named like the entry (or like the last part of its Hub id) under one of the directories in
$SPECEXEC_MODEL_DIRS (separated like PATH). The config.json of most entries ships beside this file
(configs/<name>/, SHIPPED_CONFIGS), so `specexec plan --model NAME` plans offline before anything is downloaded.

Does not know: how a checkpoint loads (loading.py), the network (nothing is downloaded or queried online),
terminal output.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cpu_kernels.cache_root import default_cache_root
from specexec.families import family_names
from specexec.options import MAX_BUDGET, ConfigError, check_number, choices, is_self_draft

CATALOG_ENV = "SPECEXEC_MODELS_YAML"
SHIPPED_CONFIGS = Path(__file__).with_name("configs")   # <entry name>/config.json, shipped: plan by name, offline
DIRS_ENV = "SPECEXEC_MODEL_DIRS"
FAMILIES = family_names()
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
TOP_KEYS = ("version", "models")


@dataclass(frozen=True)
class ModelEntry:
    """One known model: where it lives on the Hub and how to run it as a target."""

    name: str
    hub: str
    family: str
    params: str
    drafts: tuple[str, ...] = ()
    budget: int = 64
    quant: str = "none"
    notes: str = ""
    tokenizer: str = ""             # entries naming the same tokenizer share it exactly; "" = the family's own
    local: str = ""                 # a checkpoint that exists only on this machine: its directory (hub unused)

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer this entry shares with its drafts: `tokenizer`, else its family."""
        return self.tokenizer or self.family

    @classmethod
    def from_dict(cls, name: str, raw: Any, where: str) -> "ModelEntry":
        """Build from one parsed YAML mapping; ConfigError for unknown keys, missing keys or bad values."""
        at = f"{where}: model {name!r}"
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(f"{where}: model name {name!r} must be letters, digits, '.', '_' or '-'")
        if not isinstance(raw, dict):
            raise ConfigError(f"{at} must be a mapping of keys, got {type(raw).__name__}")
        known = [f.name for f in fields(cls) if f.name != "name"]
        unknown = sorted(set(raw) - set(known), key=str)
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r}; known keys: {', '.join(known)}")
        missing = [k for k in ("hub", "family", "params") if k not in raw]
        if missing:
            raise ConfigError(f"{at}: missing key {missing[0]!r}")
        values = {k: _typed(at, k, v) for k, v in raw.items()}
        entry = cls(name=name, **values)
        entry._check(at)
        return entry

    def _check(self, at: str) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"{at}: family {self.family!r} is not supported; use one of: {', '.join(FAMILIES)}")
        formats = choices("--draft-quant")                 # offload's layer formats (none, nf4, ...)
        if self.quant not in formats:
            raise ConfigError(f"{at}: quant {self.quant!r} is unknown; use one of: {', '.join(formats)}")
        try:
            check_number("budget", self.budget, low=1, high=MAX_BUDGET)
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from None
        if "/" not in self.hub and not self.local:
            raise ConfigError(f"{at}: hub {self.hub!r} is not a Hub id like org/name")

    @property
    def hub_name(self) -> str:
        return self.hub.rsplit("/", 1)[-1]

    def shipped_config(self) -> Path | None:
        """The directory holding this entry's config.json as shipped with specexec (what `plan` needs), or None."""
        found = SHIPPED_CONFIGS / self.name
        return found if (found / "config.json").is_file() else None

    def local_path(self) -> Path | None:
        """The checkpoint directory on this machine, or None (searched offline only)."""
        if self.local:
            path = Path(self.local).expanduser()
            return path.resolve() if (path / "config.json").is_file() else None
        for root in model_dirs():
            for candidate in dict.fromkeys((self.name, self.hub_name, self.hub_name.lower())):
                if (root / candidate / "config.json").is_file():
                    return (root / candidate).resolve()
        return hf_cache_path(self.hub)


_TYPES: dict[str, type] = {"hub": str, "family": str, "params": str, "drafts": list, "budget": int,
                           "quant": str, "notes": str, "tokenizer": str, "local": str}


def _typed(at: str, key: str, value: Any) -> Any:
    """value checked against the key's type; YAML numbers are accepted for params (70 -> '70')."""
    want = _TYPES[key]
    if key == "drafts" and isinstance(value, str):            # `drafts: self`: one draft
        value = [value]
    if key == "params" and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if key == "quant" and value is None:
        value = "none"
    if not isinstance(value, want) or isinstance(value, bool):
        raise ConfigError(f"{at}: {key} must be a {want.__name__}, got {value!r}")
    if key == "drafts":
        if not all(isinstance(d, str) for d in value):
            raise ConfigError(f"{at}: drafts must be a list of model names (or self), got {value!r}")
        return tuple(value)
    return value


@dataclass(frozen=True)
class Catalog:
    """All entries of one models.yaml, in file order."""

    source: str
    entries: tuple[ModelEntry, ...]

    def get(self, spec: str) -> ModelEntry | None:
        """The entry named `spec` (or with Hub id `spec`), case-insensitively; None when there is none."""
        key = spec.strip().lower()
        return next((e for e in self.entries if key in (e.name.lower(), e.hub.lower())), None)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def parse_catalog(text: str, source: str = "models.yaml") -> Catalog:
    """Parse and check a models.yaml text (ConfigError naming `source` for every problem)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping with the keys {', '.join(TOP_KEYS)}")
    unknown = sorted(set(data) - set(TOP_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{source}: unknown top-level key {unknown[0]!r}; known keys: {', '.join(TOP_KEYS)}")
    if data.get("version") != 1:
        raise ConfigError(f"{source}: version must be 1, got {data.get('version')!r}")
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise ConfigError(f"{source}: models must be a mapping of name -> entry")
    entries = tuple(ModelEntry.from_dict(name, raw, source) for name, raw in models.items())
    _check_drafts(entries, source)
    return Catalog(source, entries)


def _check_drafts(entries: tuple[ModelEntry, ...], source: str) -> None:
    by_name = {e.name: e for e in entries}
    for e in entries:
        for d in e.drafts:
            if is_self_draft(d):
                _check_self(d, f"{source}: model {e.name!r}")
                continue
            if d not in by_name:
                raise ConfigError(f"{source}: model {e.name!r} drafts with {d!r}, which is not an entry")
            if d == e.name or by_name[d].tokenizer_name != e.tokenizer_name:
                raise ConfigError(f"{source}: model {e.name!r} cannot draft with {d!r} (tokenizer "
                                  f"{by_name[d].tokenizer_name} vs {e.tokenizer_name})")


def _check_self(spec: str, at: str) -> None:
    fmt = spec.strip().partition(":")[2].strip()
    formats = choices("--draft-quant")
    if ":" in spec and fmt not in formats:
        raise ConfigError(f"{at}: draft {spec!r}: {fmt!r} is not a layer format; use self or self:FORMAT with "
                          f"FORMAT one of: {', '.join(formats)}")


DEMO_VERSION = "v2"                 # bump when `specexec demo`'s recipe (cli/demo.py) changes: a new directory


def demo_dir() -> Path:
    """Where `specexec demo` keeps its random-weight pair: <cache root>/demo/<version>/{target,draft}."""
    return default_cache_root() / "demo" / DEMO_VERSION


def demo_entries() -> tuple[ModelEntry, ...]:
    """`demo` and `demo-draft`: the demo's checkpoints by name, once `specexec demo` has built them."""
    note = "random weights, built by `specexec demo`: the whole path with nothing to download"
    return (ModelEntry("demo", "", "llama", "3M", ("demo-draft",), 8, "none", note, "demo", str(demo_dir() / "target")),
            ModelEntry("demo-draft", "", "llama", "3M", (), 8, "none", note, "demo", str(demo_dir() / "draft")))


def default_catalog_path() -> Path:
    """$SPECEXEC_MODELS_YAML, else the shipped catalogue beside this module (specexec/checkpoints/models.yaml)."""
    env = os.environ.get(CATALOG_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().with_name("models.yaml")


def load_catalog(path: Path | str | None = None) -> Catalog:
    """The catalogue at `path` (default: default_catalog_path()), parsed once per file version, and the demo's
    entries (demo_entries) unless it names its own."""
    p = Path(path) if path is not None else default_catalog_path()
    try:
        stamp = p.stat().st_mtime_ns
    except OSError:
        raise ConfigError(f"models catalogue {p} does not exist" +
                          (f" (set by ${CATALOG_ENV})" if os.environ.get(CATALOG_ENV) else "")) from None
    catalog = _load(str(p), stamp)
    named = {e.name for e in catalog}             # the demo's entries, where the cache root is now
    return Catalog(catalog.source, catalog.entries + tuple(e for e in demo_entries() if e.name not in named))


@functools.lru_cache(maxsize=8)
def _load(path: str, _stamp: int) -> Catalog:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read models catalogue {path}: {e}") from None
    return parse_catalog(text, path)


def model_dirs() -> list[Path]:
    """The directories listed in $SPECEXEC_MODEL_DIRS (os.pathsep-separated), those that exist."""
    raw = os.environ.get(DIRS_ENV, "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p and Path(p).expanduser().is_dir()]


def hf_cache_path(hub_id: str) -> Path | None:
    """The snapshot directory of `hub_id` in huggingface_hub's local cache when it is complete (config.json
    and every weight file its index names; see specexec.checkpoints.hub.missing), else None."""
    from specexec.checkpoints.hub import HubOptions, cached
    try:
        return cached(hub_id, HubOptions(offline=True))
    except (ConfigError, OSError):          # a broken cache entry means "not present"
        return None


def closest(spec: str, catalog: Catalog | None = None) -> str | None:
    """The catalogue name a mistyped `spec` most likely meant (`llama-3.1-70b-instruc`), or None."""
    import difflib

    names = [e.name for e in (catalog or load_catalog()).entries]
    found = difflib.get_close_matches(spec.lower(), names, n=1, cutoff=0.75)
    return found[0] if found else None


def find(spec: str | None, catalog: Catalog | None = None) -> ModelEntry | None:
    """The catalogue entry for a --model/--draft value, unless that value is an existing directory."""
    if not spec or Path(spec).expanduser().exists():
        return None
    return (catalog or load_catalog()).get(spec)
