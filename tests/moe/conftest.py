from __future__ import annotations

import pytest

from tests.moe import _spawn, conformance_worker

WORLD_SIZES = (2, 4, 8)
_cache: dict[int, list[dict]] = {}


def conformance_results(world: int) -> list[dict]:
    """One spawned gloo run per world size, shared by every conformance test of that size."""
    if world not in _cache:
        _cache[world] = _spawn.run_ranks(world, conformance_worker.run_all)
    return _cache[world]


@pytest.fixture(params=WORLD_SIZES, ids=[f"R{w}" for w in WORLD_SIZES])
def world(request) -> int:
    return request.param
