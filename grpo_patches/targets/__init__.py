"""Adapters: one per upstream era, each declaring the releases it covers and the methods it wraps.

An :class:`Adapter` is data: where the target class lives, which methods get which wrapper, and the
parameter names each wrapped method must have. The registry checks those names before anything is
touched, so a release whose internals moved is refused instead of patched wrong (the failure mode
of run-time source rewriting, unsloth#2896).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["Adapter"]


@dataclass(frozen=True)
class Adapter:
    key: str
    releases: SpecifierSet
    module: str
    class_name: str
    wrappers: Mapping[str, Callable] = field(default_factory=dict)
    signatures: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Source fragments upstream code must contain for the adapter's reasoning to hold (read, never
    # rewritten): e.g. that the caller still slices each rank's rows out of the rewards it gets.
    anchors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Wrappers for opt-in features whose upstream method appears later than the era's first
    # release: installed where the method exists (and passes the checks above), absent elsewhere.
    optional: frozenset[str] = frozenset()
    summary: str = ""

    def covers(self, version: Version) -> bool:
        return self.releases.contains(version, prereleases=True)

    def target_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)

    def available(self) -> dict[str, Callable]:
        """The wrappers to install: every required one, and each optional one whose method exists
        on the installed release and passes its own signature / anchor checks."""
        return {name: w for name, w in self.wrappers.items()
                if name not in self.optional or not self._problems(name, required=False)}

    def check(self) -> list[str]:
        """What in the installed release differs from what this adapter was written against."""
        try:
            self.target_class()
        except (ImportError, AttributeError) as exc:
            return [f"{self.module}.{self.class_name} not importable: {exc}"]
        names = dict.fromkeys([*self.signatures, *self.anchors])
        return [p for name in names if name not in self.optional for p in self._problems(name, required=True)]

    def _problems(self, name: str, *, required: bool) -> list[str]:
        fn = getattr(self.target_class(), name, None)
        if fn is None:
            return [f"{self.class_name}.{name} is missing"]
        problems = []
        expected = self.signatures.get(name)
        if expected is not None:
            params = tuple(p for p in inspect.signature(fn).parameters if p != "self")
            if params[: len(expected)] != expected:
                problems.append(f"{self.class_name}.{name}{params} does not start with {expected}")
        try:
            source = inspect.getsource(inspect.unwrap(fn))
        except (OSError, TypeError):
            source = ""
        problems += [f"{self.class_name}.{name} no longer contains {frag!r}"
                     for frag in self.anchors.get(name, ()) if frag not in source]
        return problems
