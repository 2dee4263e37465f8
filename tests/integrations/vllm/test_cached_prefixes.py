"""The proxy's estimate of a prompt's storage hits (:class:`CachedPrefixes`): leading stored blocks, never the last
token, least recently used blocks forgotten first, bounds refused. Runs without vLLM."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath import errors
from ascend_dualpath.integrations.vllm.cached_prefixes import CachedPrefixes

ids = st.lists(st.integers(0, 3), max_size=80)  # a small alphabet: prompts often share prefixes


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(stored=st.lists(ids, max_size=4), prompt=ids, block_size=st.integers(1, 8))
def test_hits_are_the_longest_run_of_stored_leading_blocks_below_the_last_token(stored, prompt, block_size):
    prefixes = CachedPrefixes(block_size)
    for p in stored:
        prefixes.store(p)
    shared = max((_common(p, prompt) // block_size for p in stored), default=0)  # blocks some stored prompt has
    expected = min(shared, max(0, len(prompt) - 1) // block_size) * block_size
    assert prefixes.cached_tokens(prompt) == expected


def test_a_prompt_hits_its_own_full_blocks_but_computes_its_last_token():
    prefixes = CachedPrefixes(4)
    prefixes.store(list(range(10)))  # two full blocks stored, the tail of 2 tokens is not
    assert prefixes.cached_tokens(list(range(10))) == 8
    assert prefixes.cached_tokens(list(range(8))) == 4  # its second block holds its last token
    assert prefixes.cached_tokens(list(range(9))) == 8
    assert prefixes.cached_tokens([0, 1, 2, 9, 4, 5, 6, 7, 8]) == 0  # the first block differs: nothing after counts
    assert prefixes.cached_tokens([]) == 0 and len(prefixes) == 2


def test_the_least_recently_used_blocks_are_forgotten_first():
    prefixes = CachedPrefixes(2, capacity_blocks=4)
    a, b, c = [1, 1, 1, 1, 9], [2, 2, 2, 2, 9], [3, 3, 3, 3, 9]
    prefixes.store(a)
    prefixes.store(b)
    assert prefixes.cached_tokens(a) == 4  # a is used again: b is now the oldest
    prefixes.store(c)
    assert len(prefixes) == 4
    assert (prefixes.cached_tokens(a), prefixes.cached_tokens(b), prefixes.cached_tokens(c)) == (4, 0, 4)


@pytest.mark.parametrize("value", [0, -1, 1.5, math.nan, math.inf, True])
def test_bounds_are_refused_with_their_name(value):
    for kwargs in ({"block_size": value}, {"block_size": 16, "capacity_blocks": value}):
        with pytest.raises((errors.ConfigError, errors.ArgumentTypeError), match=next(reversed(kwargs))):
            CachedPrefixes(**kwargs)
