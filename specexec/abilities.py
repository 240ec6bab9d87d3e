"""Optional abilities: `has(obj, Ability)` says whether an object offers one, for the engine to ask once at
construction instead of looking members up with getattr on every step.

An ability is a small `typing.runtime_checkable` Protocol (builder abilities in specexec/builders/base.py,
model abilities in specexec/network/model.py, the companions' hooks in specexec/companions/protocol.py). `has`
is isinstance against it, and also accepts objects that offer the members through `__getattr__` (wrappers
that delegate to a builder: Python >= 3.12's isinstance looks members up statically and would miss them).

Does not know: which abilities exist or what they mean.
"""
from __future__ import annotations

from typing import Any


def members(ability: type) -> list[str]:
    """The public names an ability Protocol declares (methods, properties and annotated attributes)."""
    names = {n for n in vars(ability) if not n.startswith("_")}
    return sorted(names | set(getattr(ability, "__annotations__", {})))


def has(obj: Any, ability: type) -> bool:
    """Whether `obj` offers every member of the runtime-checkable Protocol `ability` (None never does)."""
    if obj is None:
        return False
    return isinstance(obj, ability) or all(hasattr(obj, name) for name in members(ability))
