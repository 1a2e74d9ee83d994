"""Shared prefixes: the KV cache of a prompt's record-independent start, computed once and reused.

The split point comes from :meth:`.prompts.Prompts.shared_head` and depends only on the record itself, never
on its neighbours, so an answer does not change with what came before it. A new prefix that begins with one
already cached (a ``--chat`` turn's head: the last turn's head, its question and answer) is computed from that
one's KV cache on, not from the start. Where the engine gives a file for
a prefix (``store``), its KV cache is also kept between runs: a process started per file (``make``,
``xargs``) reads its system prompt's cache instead of computing it again. The file's name carries everything
that decides the numbers (tokens, dtype, device, versions, code), so a kept cache is the one a run would
compute.

In one run the engine keeps the last ``PREFIX_CACHE_ENTRIES`` prefixes (least recently used first out).
:func:`prefill` runs a prompt's tokens into a KV cache a chunk at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..cachefiles import check_safetensors, scratch, seal_metadata, seal_safetensors
from .prompts import common_prefix

__all__ = ["MIN_PREFIX_TOKENS", "PREFIX_CACHE_ENTRIES", "PrefixCache", "prefill"]

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are not worth a cache entry
PREFIX_CACHE_ENTRIES = 4  # distinct prefixes kept (system prompts / templates in one run); LRU
PREFIX_FILES_KEPT = 16  # prefix files kept per model between runs; the least recently used go first
PREFIX_FILE_MAX_BYTES = 256 << 20  # larger KV caches are not written (reading them would not pay)


class PrefixCache:
    """The KV caches of the last :data:`PREFIX_CACHE_ENTRIES` shared prefixes of one model."""

    def __init__(
        self,
        model: Any,
        prefill_step: int,
        store: Callable[[tuple[int, ...]], Path | None] | None = None,
    ) -> None:
        """``store``: the file keeping a prefix's KV cache between runs (None: not kept)."""
        self.model = model
        self.prefill_step = prefill_step
        self.store = store
        self._entries: OrderedDict[tuple[int, ...], list[Any]] = OrderedDict()

    def clear(self) -> None:
        """Forget every prefix (the next record computes its own again)."""
        self._entries.clear()

    def split(
        self, head: Sequence[int], tokens: list[int], *, keep: bool = True
    ) -> tuple[int, list[Any] | None]:
        """How many of ``tokens`` come from the cached prefix ``head`` shares with them, and a private copy
        of that prefix's KV cache; ``(0, None)`` when there is none worth reusing. ``keep``: whether its
        KV cache may be kept between runs (a shared start is; one record's whole prompt is not)."""
        n = common_prefix(head, tokens[:-1])  # at least one token must remain to start generation
        if n < MIN_PREFIX_TOKENS:
            return 0, None
        key = tuple(tokens[:n])
        cache = self._entries.get(key)
        if cache is None:
            cache = make_prompt_cache(self.model)
            if not all(type(c) is KVCache for c in cache):
                return 0, None  # sliding-window or recurrent caches cannot be shared by slicing
            path = self.store(key) if self.store is not None and keep else None
            if path is None or not _read_kv(path, cache, n):
                # A conversation's next turn starts with the last turn's head: only the rest is computed.
                start, base = self._longest_within(key)
                if base is not None:
                    cache = [_copy_kv(c, start) for c in base]
                prefill(self.model, cache, key, step=self.prefill_step, start=start)
                if path is not None:
                    _write_kv(path, cache, n)
            self._entries[key] = cache
            if len(self._entries) > PREFIX_CACHE_ENTRIES:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return n, [_copy_kv(c, n) for c in cache]

    def _longest_within(self, key: tuple[int, ...]) -> tuple[int, list[Any] | None]:
        """The longest cached prefix that ``key`` begins with: its length and its KV cache; ``(0, None)``."""
        best: tuple[int, ...] = ()
        for other in self._entries:
            if len(best) < len(other) < len(key) and key[: len(other)] == other:
                best = other
        if not best:
            return 0, None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]


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


def _read_kv(path: Path, cache: list[Any], n: int) -> bool:
    """Fill ``cache`` (fresh, one per layer) with the ``n`` positions kept at ``path``; False when there is
    no such file, it does not fit, or it is not whole: its data's SHA-256 is not the one sealed in it (the
    caller computes them, and the file is written again)."""
    if not path.is_file() or check_safetensors(path) is not None:
        return False
    try:
        kept: Any = mx.load(str(path))
        arrays = [(kept[f"{i}.keys"], kept[f"{i}.values"]) for i in range(len(cache))]
    except (OSError, RuntimeError, ValueError, KeyError):
        return False
    if len(kept) != 2 * len(cache) or any(
        k.ndim != 4 or k.shape[2] != n or v.shape[2] != n for k, v in arrays
    ):
        return False
    for c, (k, v) in zip(cache, arrays, strict=True):
        c.keys, c.values, c.offset = k, v, n
    mx.eval([c.state for c in cache])
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: kept longest
    return True


def _write_kv(path: Path, cache: list[Any], n: int) -> None:
    """Keep ``cache``'s first ``n`` positions at ``path`` (published whole, by rename), then drop the least
    recently used of the model's other prefix files beyond :data:`PREFIX_FILES_KEPT`. Best effort: a cache
    directory that cannot be written only costs the next run the computing."""
    arrays = {}
    for i, c in enumerate(cache):
        arrays[f"{i}.keys"], arrays[f"{i}.values"] = c.keys[..., :n, :], c.values[..., :n, :]
    if sum(a.nbytes for a in arrays.values()) > PREFIX_FILE_MAX_BYTES:
        return
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        with scratch(path.parent) as room:
            tmp = room / path.name
            mx.save_safetensors(str(tmp), arrays, metadata=seal_metadata())
            seal_safetensors(tmp)  # its data's SHA-256, checked before it is read
            os.replace(tmp, path)
        stem = path.name.split(".prefix-")[0]
        kept = sorted(path.parent.glob(f"{stem}.prefix-*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[PREFIX_FILES_KEPT:]:
            old.unlink(missing_ok=True)
