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
        _cache[strategy] = _spawn.run_ranks(
            GPUS, conformance_worker.run_all, strategy, "cuda", backend="nccl", timeout_s=140
        )
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

    assert abs(expected_ranks_per_token(256, 8, 2) - 2 * (1 - 0.5**8)) < 0.01
    assert choose_num_sms(256, 8, 2, 132) == 68
    assert choose_num_sms(256, 8, 2, 132, sm_write_gbs=50.0) == 24
    assert choose_num_sms(256, 8, 8, 132) % 2 == 0
    assert choose_num_sms(256, 8, 2, 40) == 40
    assert choose_num_sms(8, 8, 1, 132) == 4


class _FakeCompiled:
    """A compiled binary: records direct launches; ``refuse`` makes its launcher reject the arguments."""

    def __init__(self, log: list, refuse: bool) -> None:
        self.log, self.refuse = log, refuse

    def __getitem__(self, grid):
        def run(*args):
            if self.refuse:
                raise TypeError("function takes exactly 9 arguments")
            self.log.append(("direct", grid, args))

        return run


class _FakeKernel:
    """A JIT kernel ``k(a, b, n, X: constexpr, Y: constexpr)``: records launches through Triton."""

    arg_names = ["a", "b", "n", "X", "Y"]

    def __init__(self, refuse: bool = False) -> None:
        self.log: list = []
        self.refuse = refuse

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _FakeCompiled(self.log, self.refuse)

        return run


def test_launch_site_calls_the_compiled_launcher_directly_after_the_first_launch(monkeypatch):
    """MoE launch sites (the shared LaunchSite, keyed on pointer alignment): later launches skip Triton's
    binding, with all parameters in declaration order and the constexprs after the call's arguments; a different
    pointer alignment or a launcher that refuses the call goes back through Triton (the refusal also for every
    later site); ``ADP_MOE_DIRECT_LAUNCH=0`` keeps every launch on Triton's JIT."""
    from ascend_dualpath._triton_launch import LaunchSite
    from ascend_dualpath.moe.strategies import cuda

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(LaunchSite, "direct_ok", True)
    monkeypatch.delenv("ADP_MOE_DIRECT_LAUNCH", raising=False)
    monkeypatch.delenv("ADP_DIRECT_LAUNCH", raising=False)
    assert cuda._site(_FakeKernel(), 1, {}).mode == "direct"
    monkeypatch.setenv("ADP_MOE_DIRECT_LAUNCH", "0")
    assert cuda._site(_FakeKernel(), 1, {}).mode == "jit"

    kernel = _FakeKernel()
    # "runner" goes through compiled[grid] (the fake's launcher); "direct" differs only in how it reaches the
    # binary's C launcher, which needs a GPU.
    launch = LaunchSite(kernel, 7, dict(X=4, Y=True, num_warps=16), mode="runner")
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    aligned = cuda._aligned(a)
    launch(a, b, 3, key=aligned)
    launch(a, b, 3, key=aligned)
    assert kernel.log[0] == ("triton", (7,), (a, b, 3), dict(X=4, Y=True, num_warps=16))
    assert kernel.log[1] == ("direct", (7, 1, 1), (a, b, 3, 4, True))
    shifted = a[1:]  # 4 bytes off: Triton specialised the binary on a 16-byte-aligned pointer
    assert cuda._aligned(shifted) == (False,)
    launch(shifted, b, 3, key=cuda._aligned(shifted))
    assert kernel.log[2][0] == "triton" and kernel.log[2][2][0] is shifted
    assert len(kernel.log) == 3

    refusing = _FakeKernel(refuse=True)
    site = LaunchSite(refusing, 2, dict(X=1, Y=False), mode="runner")
    site(a, b, 3, key=aligned)
    site(a, b, 3, key=aligned)  # the direct call raises before launching: relaunched through Triton
    assert [entry[0] for entry in refusing.log] == ["triton", "triton"]
    assert LaunchSite.direct_ok is False
    other = _FakeKernel()
    later = LaunchSite(other, 2, dict(X=1, Y=False), mode="runner")
    later(a, b, 3, key=aligned)
    later(a, b, 3, key=aligned)
    assert [entry[0] for entry in other.log] == ["triton", "triton"]


class _FakeGraphStrategy:
    """Host bookkeeping of the cuda strategy (no GPU): each data op takes the next epoch; records its half."""

    graph_capturable = True

    def __init__(self) -> None:
        self.data_epoch = self.count_epoch = 0
        self.generation = 1
        self.halves: list[int] = []

    def op(self) -> int:
        self.data_epoch += 1
        self.halves.append(self.data_epoch % 2)
        return self.data_epoch % 2


class _FakeGraph:
    def __init__(self) -> None:
        self.ops: list = []

    def replay(self) -> None:
        self.ops.append("replay")


def _graph_buffer(monkeypatch):
    from ascend_dualpath.moe import buffer as buffer_module

    captured: list = []

    class Capture:
        def __init__(self, graph) -> None:
            captured.append(graph)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    buffer = buffer_module.Buffer.__new__(buffer_module.Buffer)
    buffer.strategy, buffer.strategy_name, buffer._destroyed = _FakeGraphStrategy(), "cuda", False
    return buffer, captured


def test_capture_graph_records_one_variant_per_data_half_and_replays_the_matching_one(monkeypatch):
    """Host side of Buffer.capture_graph (the GPU side runs in the conformance check graph_replay): two eager
    warm-ups, one capture per parity of the first op's epoch with the host epoch restored, and replay picking
    the variant for the current epoch and advancing it by the ops recorded."""
    from ascend_dualpath.errors import ConfigError

    buffer, captured = _graph_buffer(monkeypatch)
    strategy = buffer.strategy
    strategy.data_epoch = 6
    graph = buffer.capture_graph(lambda: (strategy.op(), strategy.op(), strategy.op()))
    # warm-ups: epochs 7..12 (halves 1 0 1 0 1 0); captures start in half 0, then half 1; the epoch is restored
    assert strategy.halves == [1, 0, 1, 0, 1, 0] + [0, 1, 0] + [1, 0, 1]
    assert strategy.data_epoch == 12 and graph.num_ops == 3 and len(captured) == 2
    assert graph.replay() == (1, 0, 1)  # next epoch 13: half 1
    assert strategy.data_epoch == 15
    strategy.op()  # an eager op in between
    assert graph.replay() == (1, 0, 1) and strategy.data_epoch == 19
    assert graph.replay() == (0, 1, 0) and strategy.data_epoch == 22
    assert captured[0].ops == ["replay"] and captured[1].ops == ["replay", "replay"]
    strategy.generation += 1
    with pytest.raises(ConfigError, match="capture again"):
        graph.replay()
    assert strategy.data_epoch == 22

    def fresh_dispatch():
        strategy.count_epoch += 1
        strategy.op()

    with pytest.raises(ConfigError, match="only cached"):
        buffer.capture_graph(fresh_dispatch)
    with pytest.raises(ConfigError, match="no cached dispatch or combine"):
        buffer.capture_graph(lambda: None)
    buffer._destroyed = True
    with pytest.raises(ConfigError, match="destroyed"):
        graph.replay()
