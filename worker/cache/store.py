"""The byte-bounded LRU store of cached states.

Entries are runner states (opaque here) with the head score at their last token when the request
that left them read one, the exact tokens before them (compared on every hit) and their size in
bytes, as the runner measured it. Inserting past the budget evicts least recently used entries;
an entry larger than the whole budget is not kept. A budget of 0 turns the cache off. Lookups
come from the RPC threads (at admission), inserts from the scheduler's thread: one lock.

An entry may *require* others: the states a later lookup must hit on its way down to it (the ends
of the segments above it, prepare.py). It is kept only while they are: evicting one evicts what
requires it, and what requires that, and so on down (one key may be kept under one request's
chain and hung from by another request's: a one-level eviction once left entries whose
requirement was gone, and a lookup that reached one failed with KeyError); an entry whose
requirements are missing is not inserted, and inserting or hitting it makes its requirements
more recent than itself, the shallowest most recent. So the LRU order
drops a prompt's deepest states first; before, a long prompt's own later deposits evicted its
first ones, leaving the rest in the budget and unreachable (a repeat of it hit nothing).
States are never written after they are made (runners read parents, never write them), so an
entry handed to several requests at once is safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from openjev.worker.cache.keys import CutRule, NodeKey

# (state) -> (the state to keep, e.g. compacted, and its size in bytes)
Measure = Callable[[Any], tuple[Any, int]]


@dataclass(frozen=True)
class Entry:
    state: Any
    score: float | None
    tokens: bytes
    nbytes: int
    requires: tuple[NodeKey, ...] = ()  # root first


class CacheListener(Protocol):
    """Where hits, inserts and evictions are reported (Prometheus in the worker)."""

    def on_hit(self, tokens: int) -> None: ...
    def on_insert(self, nbytes: int) -> None: ...
    def on_evict(self, count: int, nbytes: int) -> None: ...


class StateCache:
    def __init__(
        self,
        budget_bytes: int,
        fingerprint: str,
        rule: CutRule,
        measure: Measure,
        *,
        deposits_per_segment: int = 4,
        listener: CacheListener | None = None,
        min_entry_bytes: int = 1,
    ):
        if budget_bytes < 0:
            raise ValueError("the state cache budget must be >= 0 bytes")
        if deposits_per_segment < 0:
            raise ValueError("deposits_per_segment must be >= 0")
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.rule = rule
        self.deposits_per_segment = deposits_per_segment
        self.min_entry_bytes = max(1, min_entry_bytes)  # no state is smaller: a smaller budget keeps none
        self._measure = measure
        self._listener = listener
        self._entries: OrderedDict[NodeKey, Entry] = OrderedDict()
        self._dependents: dict[NodeKey, set[NodeKey]] = {}  # key -> the entries that require it
        self._lock = threading.Lock()
        self.nbytes = 0
        self.num_hits = 0
        self.hit_tokens = 0
        self.num_inserts = 0
        self.num_evictions = 0

    @property
    def enabled(self) -> bool:
        """Off below one state's bytes: nothing could be kept, so nothing is cut or copied for it."""
        return self.budget_bytes >= self.min_entry_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def contains(self, key: NodeKey) -> bool:
        with self._lock:
            return key in self._entries

    def lookup(self, key: NodeKey, tokens: Callable[[], bytes]) -> Entry | None:
        """The entry under key whose tokens equal tokens() (computed only when one is found),
        made the most recently used; None otherwise."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry.tokens != tokens():
            return None
        with self._lock:
            if key in self._entries:
                self._touch(key)
        return entry

    def record_hit(self, tokens: int) -> None:
        """A request hangs from cached states, skipping `tokens` tokens."""
        with self._lock:
            self.num_hits += 1
            self.hit_tokens += tokens
        if self._listener is not None:
            self._listener.on_hit(tokens)

    def lacks_score(self, key: NodeKey) -> bool:
        """Whether the entry under key was kept without a head score (its segment had no reader
        then): a segment that reads one there deposits it again to add it."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.score is None

    def _kept_with_score(self, key: NodeKey, score: float | None) -> bool:
        """Under the lock: True if key is kept (made the most recently used), taking `score`
        where the entry had none (the state is the same bits either way)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.score is None and score is not None:
            self._entries[key] = replace(entry, score=score)
        self._touch(key)
        return True

    def _touch(self, key: NodeKey) -> None:
        """Under the lock: key, then its requirements (deepest first), made the most recent."""
        self._entries.move_to_end(key)
        for required in reversed(self._entries[key].requires):
            self._entries.move_to_end(required)

    def _evict(self, key: NodeKey) -> tuple[int, int]:
        """Under the lock: drop key, every entry that requires it, every entry that requires one
        of those, and so on; (entries, bytes) freed."""
        count, freed = 0, 0
        pending = [key]
        while pending:
            gone = pending.pop()
            pending.extend(self._dependents.pop(gone, ()))
            entry = self._entries.pop(gone, None)
            if entry is None:
                continue
            count, freed = count + 1, freed + entry.nbytes
            for required in entry.requires:
                self._dependents.get(required, set()).discard(gone)
        self.nbytes -= freed
        return count, freed

    def _ancestry(self, keys: tuple[NodeKey, ...]) -> set[NodeKey]:
        """Under the lock: keys (all kept), what they require, what that requires, and so on: the
        entries an eviction must not touch for an entry requiring keys to stay reachable."""
        found: set[NodeKey] = set()
        pending = list(keys)
        while pending:
            if (key := pending.pop()) not in found:
                found.add(key)
                pending.extend(self._entries[key].requires)
        return found

    def insert(
        self, key: NodeKey, state: Any, score: float | None, tokens: bytes, requires: tuple[NodeKey, ...] = ()
    ) -> bool:
        """Keep a state (evicting least recently used ones to fit, never one it requires); False
        if it alone exceeds the budget, a state it requires is not kept (it could never be
        reached), the others it requires leave no room, or the cache is off. An existing entry
        keeps its state (the same bits) and takes the score if it had none."""
        if not self.enabled:
            return False
        with self._lock:
            if self._kept_with_score(key, score):
                return True
        kept, nbytes = self._measure(state)
        nbytes += len(tokens)
        if nbytes > self.budget_bytes:
            return False
        evicted, freed = 0, 0
        with self._lock:
            if self._kept_with_score(key, score):
                return True
            if not all(r in self._entries for r in requires):
                return False
            # its chain and the chains those entries were kept under: an eviction reaches none of
            # them (each requires only protected entries), so what the new entry requires stays
            protected = self._ancestry(requires)
            if sum(self._entries[r].nbytes for r in protected) + nbytes > self.budget_bytes:
                return False  # its chain and it do not fit together: nothing evicted for it
            while self.nbytes + nbytes > self.budget_bytes:
                victim = next(k for k in self._entries if k not in protected)
                count, size = self._evict(victim)
                evicted, freed = evicted + count, freed + size
            self._entries[key] = Entry(kept, score, tokens, nbytes, requires)
            self.nbytes += nbytes
            for required in requires:
                self._dependents.setdefault(required, set()).add(key)
            self._touch(key)
            self.num_inserts += 1
            self.num_evictions += evicted
        if self._listener is not None:
            self._listener.on_insert(nbytes)
            if evicted:
                self._listener.on_evict(evicted, freed)
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._dependents.clear()
            self.nbytes = 0
