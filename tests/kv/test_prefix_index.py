from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import InvalidKey
from ascend_dualpath.kv.layout import block_hashes
from ascend_dualpath.kv.prefix_index import PrefixIndex

BLOCK_TOKENS = 2
sequences = st.lists(st.integers(0, 2), max_size=10)  # tiny vocab: many shared prefixes


def brute_force_longest(cached: set[tuple[int, ...]], query: list[int]) -> int:
    """Largest k such that the query's first k blocks of tokens were cached as a prefix."""
    best = 0
    for k in range(1, len(query) // BLOCK_TOKENS + 1):
        if tuple(query[: k * BLOCK_TOKENS]) in cached:
            best = k
    return best


operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences),
        st.tuples(st.just("remove"), sequences),
        st.tuples(st.just("query"), sequences),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=operations)
def test_longest_prefix_matches_a_brute_force_model(ops):
    index = PrefixIndex()
    cached: set[tuple[int, ...]] = set()  # model: every cached token prefix (a whole number of blocks)
    for op, tokens in ops:
        ids = block_hashes(tokens, BLOCK_TOKENS)
        if op == "insert":
            index.insert_chain(ids)
            cached |= {tuple(tokens[: k * BLOCK_TOKENS]) for k in range(1, len(ids) + 1)}
        elif op == "remove" and ids:
            victim = tuple(tokens[: len(ids) * BLOCK_TOKENS])
            if victim in cached:
                removed = index.remove(ids[-1])
                doomed = {p for p in cached if p[: len(victim)] == victim}
                assert len(removed) == len(doomed)
                cached -= doomed
            else:
                with pytest.raises(InvalidKey):
                    index.remove(ids[-1])
        assert index.longest_prefix(ids) == brute_force_longest(cached, tokens)
        assert len(index) == len(cached)


def test_orphans_and_reparenting_are_refused():
    a, b, c = block_hashes([1, 1, 2, 2, 3, 3], BLOCK_TOKENS)
    index = PrefixIndex()
    with pytest.raises(InvalidKey, match="parent .* is not in the prefix index"):
        index.add(b, a)
    assert index.add(a, None) and not index.add(a, None)
    index.add(b, a)
    with pytest.raises(InvalidKey, match="indexed under parent"):
        index.add(b, None)
    assert index.longest_prefix([a, c]) == 1
    assert index.longest_prefix([b]) == 0  # b is cached but only reachable after a
    assert index.parent_of(b) == a and index.leaves() == [b]


def test_from_edges_rebuilds_in_any_order_and_skips_orphans():
    ids = block_hashes(list(range(12)), BLOCK_TOKENS)
    orphan_parent, orphan = block_hashes([9] * 4, BLOCK_TOKENS)
    edges = [(ids[i], ids[i - 1] if i else None) for i in range(len(ids))][::-1] + [(orphan, orphan_parent)]
    index = PrefixIndex.from_edges(edges)
    assert index.longest_prefix(ids) == len(ids)
    assert orphan not in index and len(index) == len(ids)
