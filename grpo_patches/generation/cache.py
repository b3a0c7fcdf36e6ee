"""One static KV cache per (batch, length), reset in place between calls, released on request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["CACHE_ARGS", "StaticCachePool", "brought_cache"]

#: The names a KV cache is passed by: transformers 5.24 renamed ``past_key_values`` (of ``generate`` and of the
#: models' forwards) to ``cache``; the old name warns there on every call and leaves the forwards in 5.40.
CACHE_ARGS = ("cache", "past_key_values")


def brought_cache(kwargs: Mapping[str, Any]) -> str:
    """The name a ``generate`` call brings its own cache by, or ``""``."""
    return next((name for name in CACHE_ARGS if kwargs.get(name) is not None), "")


class StaticCachePool:
    """Static caches reused across generation calls, reset in place (same tensors, same addresses).

    transformers allocates a new ``StaticCache`` per ``generate`` call; its tensors are
    ``mark_static_address``-ed, so with CUDA graphs (``mode="reduce-overhead"``) every new address
    makes the graph re-record once per call (and each recording stays in the CUDA-graph tree). One
    cache per (batch, length), reset before each call, keeps one recording replayed for good.
    ``length`` is the high-water cache length: it never shrinks, so a shorter prompt reuses it.
    :meth:`release` drops the caches (the memory goes back to the allocator for the training
    phase); the next call builds them again, usually at the same addresses (the allocator hands the
    freed block back), and a CUDA graph whose cache moved re-records once.
    """

    def __init__(self) -> None:
        self.length = 0
        self.caches: dict[tuple[int, int], Any] = {}
        self.built = 0  # caches constructed (a release makes the next call build again)
        self.graphs: dict = {}  # the fused loop's captured CUDA graphs over these caches (fused_loop)

    def grow(self, wanted: int) -> int:
        if wanted > self.length:
            self.length = wanted
            self.caches = {k: v for k, v in self.caches.items() if k[1] == wanted}
            self.graphs = {}
        return self.length

    def get(self, model: nn.Module, batch: int) -> Any:
        from transformers import StaticCache

        key = (batch, self.length)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = StaticCache(config=model.config, max_cache_len=self.length)
            self.built += 1
        else:
            cache.reset()
        return cache

    def release(self, keep_graphs: bool = False) -> None:
        """Drop the caches; ``keep_graphs``: keep the captured graphs (each is replayed only over caches
        back at its recorded addresses) but forget a failed capture, which the next caches may not repeat."""
        self.caches = {}
        kept = self.graphs if keep_graphs else {}
        self.graphs = {k: v for k, v in kept.items() if getattr(v, "graph", None) is not None}
