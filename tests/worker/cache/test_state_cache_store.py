"""The LRU store and the cut rule, without a model: budget, eviction order, exact token check,
listener counts, and where the grid and the anchors put cuts."""

from __future__ import annotations

import hashlib

import pytest

from openjev.worker.cache.keys import CutRule, NodeKey, advance, token_bytes
from openjev.worker.cache.store import StateCache


class Listener:
    def __init__(self):
        self.hits, self.inserts, self.evicted = [], 0, 0

    def on_hit(self, tokens):
        self.hits.append(tokens)

    def on_insert(self, nbytes):
        self.inserts += 1

    def on_evict(self, count, nbytes):
        self.evicted += count


def store(budget: int, listener=None) -> StateCache:
    # a "state" here is its size in bytes
    return StateCache(budget, "fp", CutRule(anywhere=False), lambda s: (s, s), listener=listener)


def key(position: int) -> NodeKey:
    return NodeKey("fp", (), position, bytes([position % 256]) * 32)


def test_lru_eviction_within_budget():
    listener = Listener()
    cache = store(1000, listener)
    tokens = {p: token_bytes(range(p)) for p in (10, 20, 30, 40)}  # 40, 80, 120, 160 bytes
    assert cache.insert(key(10), 300, None, tokens[10])
    assert cache.insert(key(20), 300, 1.5, tokens[20])
    assert cache.lookup(key(10), lambda: tokens[10]) is not None  # 10 is now the most recent
    assert cache.insert(key(30), 300, None, tokens[30])  # 1000 bytes would overflow: 20 goes
    assert cache.lookup(key(20), lambda: tokens[20]) is None
    assert cache.lookup(key(10), lambda: tokens[10]) is not None
    assert cache.nbytes == 340 + 420 and cache.nbytes <= 1000
    assert cache.num_evictions == 1 and listener.evicted == 1 and listener.inserts == 3
    assert not cache.insert(key(40), 2000, None, tokens[40])  # larger than the whole budget
    assert len(cache) == 2


def test_a_key_with_other_tokens_is_a_miss():
    """Equal keys (a forged digest) but other tokens: never handed out."""
    cache = store(1 << 20)
    cache.insert(key(5), 10, None, token_bytes([1, 2, 3, 4, 5]))
    assert cache.lookup(key(5), lambda: token_bytes([1, 2, 3, 4, 6])) is None
    entry = cache.lookup(key(5), lambda: token_bytes([1, 2, 3, 4, 5]))
    assert entry is not None and entry.state == 10 and entry.nbytes == 10 + 20


def test_off_keeps_nothing():
    listener = Listener()
    cache = store(0, listener)
    assert not cache.enabled and not cache.insert(key(1), 1, None, b"")
    assert len(cache) == 0 and listener.inserts == 0
    with pytest.raises(ValueError):
        store(-1)


def test_hits_are_reported():
    listener = Listener()
    cache = store(100, listener)
    cache.record_hit(640)
    assert (cache.num_hits, cache.hit_tokens, listener.hits) == (1, 640, [640])


def test_grid_and_anchors():
    cpu, gpu = CutRule(anywhere=False), CutRule(anywhere=True)
    assert cpu.grid_points(0, 200, 0) == [64, 128, 192]
    assert cpu.grid_points(100, 400, 100) == [164, 228, 292, 356]
    assert gpu.grid_points(100, 400, 100) == [128, 192, 256, 320, 384]
    assert cpu.neutral(164, 100) and not cpu.neutral(128, 100) and gpu.neutral(101, 0)
    assert cpu.floor(399, 100) == 356 and gpu.floor(399, 100) == 384


def test_a_chain_is_kept_whole_and_evicted_from_its_deepest_state():
    """An entry requires the ends above it (what a lookup passes on the way down): it is not
    inserted without them, inserting or hitting it makes them more recent than itself, an
    eviction takes the chain's deepest state first, and evicting a state evicts what requires
    it (a long prompt's own later deposits once evicted its first ones, leaving the rest
    unreachable in the budget)."""
    listener = Listener()
    cache = store(1000, listener)
    t = {p: token_bytes(range(p)) for p in (10, 20, 30, 40)}  # 40, 80, 120, 160 bytes
    assert not cache.insert(key(20), 100, None, t[20], requires=(key(10),))  # 10 is not kept
    assert cache.insert(key(10), 100, None, t[10])
    assert cache.insert(key(20), 100, None, t[20], requires=(key(10),))
    assert cache.insert(key(30), 100, None, t[30], requires=(key(10), key(20)))
    assert list(cache._entries) == [key(30), key(20), key(10)]  # the root end the most recent
    assert cache.insert(key(40), 301, None, t[40])  # 1,001 bytes would overflow: 30 goes, not 10
    assert [k.position for k in cache._entries] == [20, 10, 40] and cache.nbytes == 180 + 140 + 461
    assert cache.lookup(key(20), lambda: t[20]) is not None  # a hit refreshes its chain too
    assert [k.position for k in cache._entries] == [40, 20, 10]
    cache._evict(key(10))  # the root end goes: what requires it goes with it
    assert [k.position for k in cache._entries] == [40] and cache.nbytes == 461
    assert cache._dependents == {} or all(not v for v in cache._dependents.values())
    # a chain that cannot fit beside its requirements evicts nothing for it
    assert cache.insert(key(10), 400, None, t[10])
    assert not cache.insert(key(30), 700, None, t[30], requires=(key(10),))
    assert [k.position for k in cache._entries] == [40, 10]
    assert listener.evicted == cache.num_evictions == 1  # 30, for 40 (the _evict above was direct)


def test_a_key_kept_under_one_chain_and_hung_from_under_another():
    """One key can be kept under one request's chain (10, then 30) and hung from by another's
    (20, then 30): evicting 10 evicts 30 and what hangs from it (a one-level eviction left 40
    requiring a 30 that was gone, and its lookup raised KeyError), and making room for an entry
    that requires 30 never evicts 10, which 30 requires (it did, leaving the new entry placed,
    uncounted and requiring a missing state)."""
    t = {p: token_bytes(range(p)) for p in (10, 20, 30, 40, 50, 60)}
    cache = store(10_000)
    assert cache.insert(key(10), 100, None, t[10])
    assert cache.insert(key(20), 100, None, t[20])
    assert cache.insert(key(30), 100, None, t[30], requires=(key(10),))  # the first request's chain
    assert cache.insert(key(40), 100, None, t[40], requires=(key(20), key(30)))  # the second's
    cache._evict(key(10))
    assert [k.position for k in cache._entries] == [20]
    assert cache.nbytes == 180 and not any(cache._dependents.values())

    cache = store(1000)  # entries of 140, 180, 220, 300 bytes; then one of 440
    assert cache.insert(key(10), 100, None, t[10])
    assert cache.insert(key(20), 100, None, t[20])
    assert cache.insert(key(30), 100, None, t[30], requires=(key(10),))
    assert cache.insert(key(50), 100, None, t[50])
    cache._entries.move_to_end(key(10), last=False)  # 10 first in line for eviction
    assert cache.insert(key(60), 200, None, t[60], requires=(key(20), key(30)))
    assert all(r in cache._entries for e in cache._entries.values() for r in e.requires)
    assert key(10) in cache._entries and key(50) not in cache._entries  # 50 went instead
    assert cache.nbytes == sum(e.nbytes for e in cache._entries.values()) == 980
    assert cache.lookup(key(60), lambda: t[60]) is not None


def test_the_measured_copy_is_kept_not_the_state_given():
    """measure returns what to keep (the runner's compact copy: on the torch backend a root
    segment's keys are views of the pass's buffers, which keeping the state itself would pin
    beyond the bytes counted)."""
    cache = StateCache(1000, "fp", CutRule(anywhere=False), lambda s: (("copy of", s), 10))
    tokens = token_bytes(range(5))
    assert cache.insert(key(5), "pass buffers", None, tokens)
    assert cache.lookup(key(5), lambda: tokens).state == ("copy of", "pass buffers")


def test_a_digest_is_of_the_whole_prefix_up_to_its_position():
    """Each position's digest is sha256 of every token before it, whether hashed in one segment or
    continued from a parent's hasher (a key leaving out a token would hit less, and an existing
    key takes a new request's score without comparing tokens)."""
    tokens = list(range(100, 300))
    whole, end = advance(hashlib.sha256(), 0, tokens, [64, 128, 192])
    for position, digest in whole.items():
        assert digest == hashlib.sha256(token_bytes(tokens[:position])).digest(), position
    assert end.digest() == hashlib.sha256(token_bytes(tokens)).digest()
    continued, _ = advance(hashlib.sha256(token_bytes(tokens[:50])), 50, tokens[50:], [64, 128, 192])
    assert continued == whole
