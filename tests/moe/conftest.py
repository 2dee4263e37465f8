from __future__ import annotations

import pytest

from tests.moe import _spawn, conformance_worker

WORLD_SIZES = (2, 4, 8)
# CPU strategies under conformance: name -> (Buffer strategy, environment of the ranks). "aiv-aicpu" clears the
# emulated devices' AIV dataplane bit (0x04), so the aiv kernels take the AICPU BatchWrite path.
STRATEGIES = {
    "alltoall": ("alltoall", {}),
    "aiv": ("aiv", {}),
    "aiv-aicpu": ("aiv", {"ADP_EMU_CAPABILITY_BITMAP": "0"}),
}
_cache: dict[tuple[int, str], list[dict]] = {}


def conformance_results(world: int, strategy: str = "alltoall") -> list[dict]:
    """One spawned gloo run per (world size, strategy), shared by every conformance test of that pair."""
    if (world, strategy) not in _cache:
        name, env = STRATEGIES[strategy]
        _cache[world, strategy] = _spawn.run_ranks(world, conformance_worker.run_all_with_env, env, name)
    return _cache[world, strategy]


@pytest.fixture(params=WORLD_SIZES, ids=[f"R{w}" for w in WORLD_SIZES])
def world(request) -> int:
    return request.param


@pytest.fixture(params=list(STRATEGIES))
def strategy(request) -> str:
    return request.param
