"""Subclasses of a model's own classes that the kit switches instances to (``module.__class__ = ...``).

Each keeps the name and qualified name of the class it extends (checks by class name, e.g. FSDP's wrap
policy or a repr, see the model's own class), and its instances pickle: pickle looks a class up by that
name and would find the base, so an instance reduces to ``factory(base)``, which gives the subclass again
(in a fresh process too: ``factory`` is a module-level function, found by its own name).
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

__all__ = ["same_name_subclass"]


def same_name_subclass(base: type, factory: Callable[[type], type], namespace: dict[str, Any]) -> type:
    """``base`` extended by ``namespace`` under ``base``'s own name; ``factory(base)`` must return it."""
    def __reduce_ex__(self: Any, protocol: int) -> Any:
        reduced = base.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and reduced[0] in (copyreg.__newobj__, copyreg._reconstructor):
            return (_new, (factory, base), *reduced[2:])
        return reduced  # the base pickles itself its own way

    return type(base.__name__, (base,), {**namespace, "__reduce_ex__": __reduce_ex__,
                                          "__module__": base.__module__, "__qualname__": base.__qualname__})


def _new(factory: Callable[[type], type], base: type) -> Any:
    cls = factory(base)
    return cls.__new__(cls)
