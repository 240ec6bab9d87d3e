"""The one registry of tree builders: each builder class registers itself where it is defined (`@register`,
under its own `name` attribute), and everything that names builders reads from here: the --builder help
text, `bench builders`, `make_builder` and `check_builder` (Runtime.load calls it before anything loads; an
EngineConfig does not, so building one imports no builder).

Adding a builder is adding a module to specexec/builders/ with a `@register`ed class: the first lookup imports
every module of the package once, so nothing else lists the names.

Does not know: any particular builder, the engine, the CLI. Nothing below the builders (config, options)
imports it: the builders import those, and the registry's first lookup imports every builder.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from specexec.options import ConfigError, check_choice

if TYPE_CHECKING:
    from specexec.builders.base import TreeBuilder

_FACTORIES: dict[str, Callable[..., Any]] = {}     # builder name -> class
_LOADED: list[bool] = [False]
FIXED_OPTIONS = ("name", "drafting", "needs_draft")   # fields a builder option may not set

B = TypeVar("B", bound=type)


def register(cls: B) -> B:
    """Class decorator: record `cls` under `cls.name` (a second class under the same name is a bug)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} needs a non-empty class attribute `name` to be registered")
    if _FACTORIES.get(name, cls) is not cls:
        raise ValueError(f"builder name {name!r} is registered twice ({_FACTORIES[name].__qualname__}, "
                         f"{cls.__qualname__})")
    _FACTORIES[name] = cls
    return cls


def _load_all() -> None:
    """Import every module of specexec.builders once, so each builder has registered itself."""
    if _LOADED[0]:
        return
    package = importlib.import_module(__name__.rpartition(".")[0])
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _LOADED[0] = True


def factories() -> Mapping[str, Callable[..., TreeBuilder]]:
    """Every registered builder: name -> class, sorted by name (module import order is not an order)."""
    _load_all()
    return MappingProxyType({name: _FACTORIES[name] for name in sorted(_FACTORIES)})


def names() -> tuple[str, ...]:
    """The registered builder names, sorted: the accepted values of --builder."""
    return tuple(factories())


def check_builder(name: str) -> None:
    """ConfigError (listing the registered names) unless a builder is registered under `name`."""
    check_choice("builder", name, names())


def make_builder(name: str, options: tuple[tuple[str, object], ...] = ()) -> TreeBuilder:
    """A fresh builder by name, with EngineConfig.builder_options as keyword arguments (e.g. static's
    acceptance_file); ConfigError for a name the registry lacks or an option the builder does not take."""
    check_builder(name)
    fixed = [k for k, _ in options if k in FIXED_OPTIONS or k.startswith("_")]
    if fixed:                                   # the drafting kind decides which verifiers are exact
        raise ConfigError(f"builder option(s) {', '.join(fixed)} cannot be set")
    try:
        return factories()[name](**dict(options))
    except TypeError as e:
        raise ConfigError(f"builder {name!r} does not take the options {dict(options)}: {e}") from None


def builder_needs_draft(name: str) -> bool:
    """Whether the named builder grows its tree with a draft model."""
    return bool(make_builder(name).needs_draft)
