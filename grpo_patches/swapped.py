"""Subclasses of a model's own classes that the kit switches instances to (``module.__class__ = ...``).

Each keeps the name and qualified name of the class it extends (checks by class name, e.g. FSDP's wrap
policy or a repr, see the model's own class), and its instances pickle: pickle looks a class up by that
name and would find the base, so an instance reduces to ``factory(base)``, which gives the subclass again
(in a fresh process too: ``factory`` is a module-level function, found by its own name). One subclass per
base and factory: ``torch.compile`` guards on a layer's class, so a class per layer would be a graph per layer.
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

__all__ = ["same_name_subclass"]

_MADE: dict[tuple[Callable[[type], type], type], type] = {}


def same_name_subclass(base: type, factory: Callable[[type], type], namespace: dict[str, Any]) -> type:
    """``base`` extended by ``namespace`` under ``base``'s own name, made once per ``(factory, base)`` (later
    calls return it and ignore ``namespace``); ``factory(base)`` must return it."""
    made = _MADE.get((factory, base))
    if made is not None:
        return made

    def __reduce_ex__(self: Any, protocol: int) -> Any:
        reduced = base.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and reduced[0] in (copyreg.__newobj__, copyreg._reconstructor):
            return (_new, (factory, base), *reduced[2:])
        return reduced  # the base pickles itself its own way

    made = type(base.__name__, (base,), {**namespace, "__reduce_ex__": __reduce_ex__,
                                          "__module__": base.__module__, "__qualname__": base.__qualname__})
    _MADE[(factory, base)] = made
    return made


def _new(factory: Callable[[type], type], base: type) -> Any:
    cls = factory(base)
    return cls.__new__(cls)
