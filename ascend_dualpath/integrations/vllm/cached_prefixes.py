"""What the proxy knows of the KV store: the prompt blocks of requests answered in full, by the hash chain of their
tokens.

When a request finishes, the DE's connector stores its full blocks, keyed by the prefix up to each block. A later
prompt hits the store for its longest run of leading blocks whose prefixes were stored: that many tokens are read
from storage, the rest computed. The proxy sees every request it routes and whether its answer arrived in full, so it
can estimate a request's hits before placing it instead of taking every prompt token as a hit (the answer's own
blocks are stored too, but the proxy does not see their token ids).

The proxy's own hash chain (Python's tuple hash, in this process only) keys the blocks: it need not match the
store's block ids, only tell prompts apart. At most ``capacity_blocks`` blocks are kept, the least recently used
forgotten first: a store of bounded size forgets too, and the proxy cannot see what it forgot, so a bound that is too
large overstates the hits. Like the connector, the last prompt token is never a hit: at least one token is computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ascend_dualpath._checks import check_bound

DEFAULT_CAPACITY_BLOCKS = 1 << 18  # 4 Mi tokens at vLLM's 16-token blocks; an entry costs ~100 bytes


class CachedPrefixes:
    """The prompt blocks the store is taken to hold, least recently used first out.

    ``block_size`` tokens per block (vLLM's KV block); ``capacity_blocks`` bounds the blocks remembered. Both must be
    positive integers."""

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        self.block_size = check_bound("block_size", block_size, integer=True, where="CachedPrefixes")
        self.capacity_blocks = check_bound("capacity_blocks", capacity_blocks, integer=True, where="CachedPrefixes")
        self._blocks: OrderedDict[int, None] = OrderedDict()  # chain hash of each stored block

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the prompt ``token_ids`` that the store holds: its leading stored blocks, in tokens, at most
        ``len(token_ids) - 1``. The blocks found count as used."""
        found = 0
        for digest in self._chain(token_ids[: max(0, len(token_ids) - 1)]):
            if digest not in self._blocks:
                break
            self._blocks.move_to_end(digest)
            found += 1
        return found * self.block_size

    def store(self, token_ids: Sequence[int]) -> None:
        """Remember every full block of ``token_ids``, the prompt of a request answered in full (forgetting the oldest
        beyond the capacity)."""
        for digest in self._chain(token_ids):
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def _chain(self, token_ids: Sequence[int]):
        """The hash of each full block together with every block before it (the store's prefix key)."""
        digest = 0
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            digest = hash((digest, tuple(token_ids[start : start + size])))
            yield digest
