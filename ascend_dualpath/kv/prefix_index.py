"""Prefix index: a trie whose nodes are Full Blocks, keyed by their hash-chain ids.

Because a block id (see :func:`ascend_dualpath.kv.layout.block_hashes`) already covers every token
before it, the trie needs no token comparison: a node is its id plus a parent link, and the longest
cached prefix of a request is the number of its leading ids present in the index. A block is only
reachable through its parent, so the index refuses orphans and removing a block removes its subtree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ascend_dualpath.errors import InvalidKey


class PrefixIndex:
    """Thread-safe trie of Full Block ids.

    ``parent is None`` marks a block that starts a sequence (its chain root is the namespace salt).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes | None, set[bytes]] = {None: set()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._parent)

    def __contains__(self, block_id: object) -> bool:
        with self._lock:
            return block_id in self._parent

    def parent_of(self, block_id: bytes) -> bytes | None:
        with self._lock:
            if block_id not in self._parent:
                raise InvalidKey(f"block {block_id.hex()} is not in the prefix index")
            return self._parent[block_id]

    def add(self, block_id: bytes, parent: bytes | None) -> bool:
        """Add one block under ``parent``; returns False when it was already present (under the same parent)."""
        with self._lock:
            return self._add_locked(block_id, parent)

    def _add_locked(self, block_id: bytes, parent: bytes | None) -> bool:
        if block_id in self._parent:
            if self._parent[block_id] != parent:
                known = self._parent[block_id]
                raise InvalidKey(
                    f"block {block_id.hex()} is indexed under parent {known.hex() if known else None}, "
                    f"not {parent.hex() if parent else None}"
                )
            return False
        if parent is not None and parent not in self._parent:
            raise InvalidKey(f"parent {parent.hex()} of block {block_id.hex()} is not in the prefix index")
        self._parent[block_id] = parent
        self._children.setdefault(parent, set()).add(block_id)
        self._children[block_id] = set()
        return True

    def insert_chain(self, block_ids: Sequence[bytes]) -> int:
        """Add a whole chain (ids of consecutive blocks from the sequence start); returns how many were new."""
        with self._lock:
            added = 0
            parent: bytes | None = None
            for block_id in block_ids:
                added += self._add_locked(block_id, parent)
                parent = block_id
            return added

    def longest_prefix(self, block_ids: Sequence[bytes]) -> int:
        """Number of leading blocks of a chain that are cached: the hit length in blocks.

        Parameters
        ----------
        block_ids : sequence of bytes
            A request's hash chain ``[n]`` from the sequence start.

        Returns
        -------
        int
            ``k`` in ``[0, n]`` such that ``block_ids[:k]`` are all indexed as a chain and ``block_ids[k]`` is not.
        """
        with self._lock:
            parent: bytes | None = None
            for matched, block_id in enumerate(block_ids):
                if self._parent.get(block_id, _ABSENT) != parent:
                    return matched
                parent = block_id
            return len(block_ids)

    def remove(self, block_id: bytes) -> list[bytes]:
        """Remove a block and every block below it (they are unreachable without it); returns the removed ids."""
        with self._lock:
            if block_id not in self._parent:
                raise InvalidKey(f"block {block_id.hex()} is not in the prefix index")
            removed: list[bytes] = []
            stack = [block_id]
            while stack:
                current = stack.pop()
                stack.extend(self._children.pop(current))
                removed.append(current)
            self._children[self._parent[block_id]].discard(block_id)
            for current in removed:
                del self._parent[current]
            return removed

    def leaves(self) -> list[bytes]:
        """Blocks with no children: the eviction candidates that strand nothing."""
        with self._lock:
            return [block_id for block_id, children in self._children.items() if block_id is not None and not children]

    def snapshot(self) -> dict[bytes, bytes | None]:
        """Copy of ``{block_id: parent}``."""
        with self._lock:
            return dict(self._parent)

    @classmethod
    def from_edges(cls, edges: Iterable[tuple[bytes, bytes | None]]) -> PrefixIndex:
        """Build an index from ``(block_id, parent)`` pairs in any order; orphans (parent missing) are skipped."""
        pending: dict[bytes | None, list[bytes]] = {}
        for block_id, parent in edges:
            pending.setdefault(parent, []).append(block_id)
        index = cls()
        frontier: list[bytes | None] = [None]
        while frontier:
            parent = frontier.pop()
            for block_id in pending.pop(parent, []):
                index._add_locked(block_id, parent)
                frontier.append(block_id)
        return index


_ABSENT = object()
