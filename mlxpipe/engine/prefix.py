"""Shared prefixes: the KV cache of a prompt's record-independent start, computed once and reused.

The split point comes from :meth:`.prompts.Prompts.shared_head` and depends only on the record itself, never
on its neighbours, so an answer does not change with what came before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .prompts import common_prefix

__all__ = ["MIN_PREFIX_TOKENS", "PREFIX_CACHE_ENTRIES", "PrefixCache", "prefill"]

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are not worth a cache entry
PREFIX_CACHE_ENTRIES = 4  # distinct prefixes kept (system prompts / templates in one run); LRU


class PrefixCache:
    """The KV caches of the last :data:`PREFIX_CACHE_ENTRIES` shared prefixes of one model."""

    def __init__(self, model: Any, prefill_step: int) -> None:
        self.model = model
        self.prefill_step = prefill_step
        self._entries: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()

    def clear(self) -> None:
        """Forget every prefix (the next record computes its own again)."""
        self._entries.clear()

    def split(self, head: Sequence[int], tokens: list[int]) -> tuple[int, list[Any] | None]:
        """How many of ``tokens`` come from the cached prefix ``head`` shares with them, and a private copy
        of that prefix's KV cache; ``(0, None)`` when there is none worth reusing."""
        n = common_prefix(head, tokens[:-1])  # at least one token must remain to start generation
        if n < MIN_PREFIX_TOKENS:
            return 0, None
        key = tuple(tokens[:n])
        cache = self._entries.get(key)
        if cache is None:
            cache = make_prompt_cache(self.model)
            if not all(type(c) is KVCache for c in cache):
                return 0, None  # sliding-window or recurrent caches cannot be shared by slicing
            prefill(self.model, cache, key, step=self.prefill_step)
            self._entries[key] = cache
            if len(self._entries) > PREFIX_CACHE_ENTRIES:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return n, [_copy_kv(c, n) for c in cache]


def prefill(model: Any, cache: list[Any], tokens: Sequence[int], *, step: int, start: int = 0) -> None:
    """Run ``tokens[start:]`` through ``model`` into ``cache``, ``step`` tokens per pass."""
    for at in range(start, len(tokens), step):
        model(mx.array(list(tokens[at : at + step]))[None], cache=cache)
        mx.eval([c.state for c in cache])


def _copy_kv(cache: Any, n: int) -> Any:
    """A KV cache holding the first ``n`` positions of ``cache``; its first update allocates new memory,
    so the shared original is never written."""
    copy = KVCache()
    copy.keys = cache.keys[..., :n, :]
    copy.values = cache.values[..., :n, :]
    copy.offset = n
    return copy
