"""The worker's cache of tree-node states across requests (docs/state-cache.md).

keys.py: exact keys and where a cut is exact; store.py: the byte-bounded LRU store;
prepare.py: a request's segments cut at deposit and hit points, hits applied; sizing.py: the
default byte budget.
"""

from openjev.worker.cache.keys import CutRule, NodeKey
from openjev.worker.cache.prepare import Prepared, prepare
from openjev.worker.cache.store import CacheListener, Entry, StateCache

__all__ = ["CacheListener", "CutRule", "Entry", "NodeKey", "Prepared", "StateCache", "prepare"]
