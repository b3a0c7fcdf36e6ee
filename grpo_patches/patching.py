"""Wrap and unwrap class attributes with wrapt, keeping the exact original objects for revert."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import wrapt

from .targets import Adapter

__all__ = ["AppliedPatch", "patch", "unpatch"]

_MISSING = object()


@dataclass
class AppliedPatch:
    adapter: Adapter
    cls: type
    originals: dict[str, Any] = field(default_factory=dict)  # name -> the class's own attribute, or _MISSING


def patch(adapter: Adapter) -> AppliedPatch:
    cls = adapter.target_class()
    applied = AppliedPatch(adapter, cls)
    try:
        for name, wrapper in adapter.available().items():
            # The class's own attribute (the function object, not a bound method): what revert restores.
            applied.originals[name] = cls.__dict__.get(name, _MISSING)
            wrapt.wrap_function_wrapper(cls, name, wrapper)
    except Exception:
        unpatch(applied)
        raise
    return applied


def unpatch(applied: AppliedPatch) -> None:
    for name, original in applied.originals.items():
        if original is _MISSING:
            if name in applied.cls.__dict__:
                delattr(applied.cls, name)
        else:
            setattr(applied.cls, name, original)
    applied.originals.clear()
