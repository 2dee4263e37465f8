"""The conformance checks on two GPUs: the ``cuda`` strategy and ``alltoall`` over nccl (skipped without GPUs)."""

from __future__ import annotations

import pytest
import torch

from tests.moe import _spawn, conformance_worker
from tests.moe.test_moe_conformance import CHECKS

GPUS = 2
_cache: dict[str, list[dict]] = {}


def _results(strategy: str) -> list[dict]:
    if strategy not in _cache:
        _cache[strategy] = _spawn.run_ranks(GPUS, conformance_worker.run_all, strategy, "cuda", backend="nccl",
                                            timeout_s=140)
    return _cache[strategy]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < GPUS, reason=f"needs {GPUS} CUDA GPUs")
@pytest.mark.parametrize("strategy", ["cuda", "alltoall"])
@pytest.mark.parametrize("check", CHECKS + ["bad_input"])
def test_conformance_on_gpus(strategy: str, check: str) -> None:
    for rank, result in enumerate(_results(strategy)):
        assert "__fatal__" not in result, result.get("__fatal__")
        assert result[f"check_{check}"] == "ok", f"{strategy} rank {rank}:\n{result[f'check_{check}']}"


def test_sm_model_uses_the_calibrated_write_speed():
    """The bandwidth model gives an even SM count in range; for 2 ranks, 256 experts, top-8 with the measured
    18 GB/s per SM it asks for 68 SMs (write bound: 478 GB/s x 2 rows per token / 18 GB/s x 1.25)."""
    from ascend_dualpath.moe.strategies.cuda import choose_num_sms, expected_ranks_per_token

    assert abs(expected_ranks_per_token(256, 8, 2) - 2 * (1 - 0.5 ** 8)) < 0.01
    assert choose_num_sms(256, 8, 2, 132) == 68
    assert choose_num_sms(256, 8, 2, 132, sm_write_gbs=50.0) == 24
    assert choose_num_sms(256, 8, 8, 132) % 2 == 0
    assert choose_num_sms(256, 8, 2, 40) == 40
    assert choose_num_sms(8, 8, 1, 132) == 4
