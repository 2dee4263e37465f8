"""Traffic classes on the real path: KV layer transfers yield the NIC to a model collective that runs at the same
time, and still progress.

Two gloo ranks in two processes, one emulated NPU each, on one fabric. The MoE ``aiv`` strategy's dispatch (the EP
all-to-all: ``moe_dispatch`` over the model-class communicator) runs while a 16 MiB KV layer transfer of rank 0
(:class:`~ascend_dualpath.dualpath.transfer_leg.TransportTransferLeg` over a KV-class communicator on the same
device, so on the same NIC) is backlogged: rank 0's NIC is paused while both post, then released, so arbitration and
not arrival order decides who gets the wire.

The emulated NIC serialises its wire in virtual time (a WQE takes ``nic_wqe_ns + bytes / link_bytes_per_ns``). The
dispatch alone finishes ``alone_ns`` after its start; with KV backlogged it finishes later by exactly the wire time KV
took while the dispatch was backlogged. So the dispatch's share of the wire while both were backlogged is
``wire / (wire + later)``, with ``wire`` its own wire time; ``later`` > 0 shows KV progressed meanwhile.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from ascend_dualpath.dualpath.traffic import QosPolicy, TrafficClass
from tests.moe import _spawn

WAIT_S = 60
TOKENS, HIDDEN = 2048, 8192  # bf16 rows of 16 KiB: 32 MiB of dispatch from each rank to the other
KV_PIECE = 32 << 10  # the big KV layer goes as 512 WQEs of 32 KiB, 64 on each of 8 vector cores (all posted at once)
KV_BYTES = 16 << 20
# Each measurement: the NIC's weights per SL (None: the devices' defaults) and the KV communicator's class.
# KV in the model's class is not a control here: inside one service level the emulated NIC serves the queue pair it
# resumed at until that queue drains, so the outcome would follow queue creation order, not the classes.
MODES = {"policy": (None, TrafficClass.KV), "equal_weights": ([1] * 8, TrafficClass.KV)}


def _wait_until(what: str, done) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {WAIT_S} s")
        time.sleep(1e-3)


def _dispatch(buffer, x, idx):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 2)
    recv_x, *_ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=torch.ones(idx.shape, dtype=torch.float32),
    )
    return recv_x


def _kv_pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)


def _rows(rank: int) -> torch.Tensor:
    """The rows rank ``rank`` dispatches: bf16 [TOKENS, HIDDEN]."""
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)


def _paused_dispatch(nic, qp, wqes: int, dispatch) -> float:
    """Run ``dispatch()`` with ``nic`` paused until its ``wqes`` WQEs are on ``qp``; returns the virtual time at
    which the NIC was paused (the dispatch starts there)."""
    nic.set_paused(True)
    start_ns = nic.virtual_time_ns
    posted = qp.head + wqes

    def release() -> None:
        _wait_until("dispatch WQEs posted", lambda: qp.head >= posted)
        nic.set_paused(False)

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        dispatch()
    finally:
        releaser.join(WAIT_S)
    return start_ns


def _measure(C, emu, buffer, rank: int, kv_fields: dict, model_wqes: int) -> dict:
    """One measurement: rank 0 backlogs a KV layer to rank 1 on its paused NIC, then its half of the dispatch."""
    import torch.distributed as dist

    from ascend_dualpath.dualpath.transfer_leg import Segment, TransportTransferLeg

    peer, device, strategy = 1 - rank, buffer.strategy.device, buffer.strategy
    nic, qp = device.nic, strategy.comm.aiv_qp(peer)
    kv = emu.init_comm(device, config=emu.comm_config(hcclBufferSize=4, **kv_fields))
    landing = device.alloc_region(KV_BYTES, C.MemKind.DEVICE_GM, 7)
    np.frombuffer(landing, dtype=np.uint8)[:] = 0
    mems: list = [None, None]
    dist.all_gather_object(mems, (landing.addr, landing.size, landing.rkey))
    result: dict = {"kv_service_level": kv.resolved["service_level"]}
    received: list = []

    def dispatch() -> None:
        received.append(_dispatch(buffer, _rows(rank), torch.full((TOKENS, 1), peer, dtype=torch.int64)))

    if rank == 0:
        kv.add_remote_mem(peer, C.RemoteMem(*mems[peer]))
        source = device.alloc_region(KV_BYTES, C.MemKind.DEVICE_GM, 7)
        np.frombuffer(source, dtype=np.uint8)[:] = _kv_pattern(KV_BYTES)
        leg = TransportTransferLeg(kv, WAIT_S, block_dim=8, sq_depth=256, max_single_aiv_payload=KV_PIECE)
        leg.register_local(source)
        dist.barrier()
        nic.set_paused(True)
        ticket = leg.submit(0, [Segment(source.addr, KV_BYTES, 0)], peer, mems[peer][0])
        # private: the engine's queue pairs are where the layer's WQEs wait while the NIC is paused
        queues = leg.engine(peer)._qps
        _wait_until("KV WQEs posted", lambda: sum(q.head for q in queues) == KV_BYTES // KV_PIECE)
        start_ns = _paused_dispatch(nic, qp, model_wqes, dispatch)
        result["model_done_ns"] = strategy.last_vtime_ns - start_ns
        result["kv_done_ns"] = leg.wait(ticket) - start_ns
        leg.close()
        source.close()
    else:
        dist.barrier()
        dispatch()
    result["dispatch_exact"] = torch.equal(received[0].view(torch.int16), _rows(peer).view(torch.int16))
    dist.barrier()  # every KV byte landed before rank 1 looks
    if rank == 1:
        result["kv_exact"] = np.array_equal(np.frombuffer(landing, dtype=np.uint8), _kv_pattern(KV_BYTES))
    dist.barrier()
    kv.close()
    landing.close()
    return result


def _contention_worker(rank: int, world: int) -> dict:
    """The dispatch alone, then once per mode of :data:`MODES` against a backlogged KV layer (rank 0's NIC)."""
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.dualpath.traffic import comm_config_fields
    from ascend_dualpath.moe import Buffer

    # KV's marking process-wide: the MoE communicator's own config must still put the dispatch in the model class
    os.environ.update(QosPolicy().hccl_env(TrafficClass.KV))
    C = _ext.load()
    peer = 1 - rank
    buffer = Buffer(None, num_nvl_bytes=1 << 26, strategy="aiv", timeout_s=WAIT_S)
    strategy = buffer.strategy
    nic = strategy.device.nic
    idx = torch.full((TOKENS, 1), peer, dtype=torch.int64)  # expert e lives on rank e: every row crosses the NIC
    out: dict = {"default_weights": list(nic.sl_weights), "modes": {}}
    # first dispatch: the communicator and windows get their final size; its WQEs and bytes are the collective's
    before = (nic.wqes_executed, nic.bytes_moved)
    _dispatch(buffer, _rows(rank), idx)
    model_wqes, model_bytes = nic.wqes_executed - before[0], nic.bytes_moved - before[1]
    qp = strategy.comm.aiv_qp(peer)
    start_ns = _paused_dispatch(nic, qp, model_wqes, lambda: _dispatch(buffer, _rows(rank), idx))
    cost = nic.cost
    out.update(
        model_service_level=qp.sl,
        model_bytes=model_bytes,
        model_wire_ns=model_wqes * cost.nic_wqe_ns + model_bytes / cost.link_bytes_per_ns,
        alone_ns=strategy.last_vtime_ns - start_ns,
    )
    for mode, (weights, traffic) in MODES.items():  # "policy" first: the device's own weights, as opened
        if weights is not None:
            nic.sl_weights = weights
        out["modes"][mode] = _measure(C, emu, buffer, rank, comm_config_fields(traffic), model_wqes)
    buffer.destroy()
    return out


@pytest.fixture(scope="module")
def contention() -> list[dict]:
    results = _spawn.run_ranks(2, _contention_worker, timeout_s=240)
    for result in results:
        assert "__fatal__" not in result, result["__fatal__"]
    return results


def model_share(pe: dict, mode: str) -> tuple[float, float]:
    """The dispatch's share of rank 0's wire while the KV layer was backlogged, and the KV wire time (ns) inside
    the dispatch's span."""
    later = pe["modes"][mode]["model_done_ns"] - pe["alone_ns"]
    return pe["model_wire_ns"] / (pe["model_wire_ns"] + later), later


def test_collective_gets_its_share_and_kv_progresses(contention):
    pe, de = contention
    policy = QosPolicy()
    assert pe["default_weights"] == policy.nic_sl_weights()  # every emulated device arbitrates by the policy
    assert pe["model_service_level"] == policy.model.service_level
    measured = pe["modes"]["policy"]
    assert measured["kv_service_level"] == policy.kv.service_level
    assert pe["model_bytes"] >= TOKENS * HIDDEN * 2  # the rows crossed this NIC
    assert measured["kv_done_ns"] > measured["model_done_ns"], measured  # KV stayed backlogged throughout
    share, kv_ns = model_share(pe, "policy")
    assert share >= 0.98, f"the collective got {share:.2%} of the wire while KV was backlogged"
    kv_wqe_ns = 50 + KV_PIECE / 25  # nic_wqe_ns + one piece at link_bytes_per_ns of the default cost model
    assert kv_ns >= kv_wqe_ns, f"KV starved: {kv_ns} ns of KV wire inside the collective"
    for result in (pe, de):
        assert all(m["dispatch_exact"] for m in result["modes"].values()), result
    assert all(m["kv_exact"] for m in de["modes"].values()), de


def test_with_equal_weights_the_collective_loses_the_wire(contention):
    """The measurement can fail: with every service level weighted alike KV takes about half the wire from the
    collective while both are backlogged (and the bytes still land exactly)."""
    pe, de = contention
    share, _ = model_share(pe, "equal_weights")
    assert share < 0.9, f"with equal weights the collective still got {share:.2%} of the wire"
    assert de["modes"]["equal_weights"]["kv_exact"] and pe["modes"]["equal_weights"]["dispatch_exact"]


# ---- which class each communicator the library makes is in ------------------------------------------------------


def test_the_engines_communicators_are_in_the_kv_class(tmp_path):
    from ascend_dualpath.dualpath.bootstrap import in_process_engines
    from ascend_dualpath.dualpath.nodes import EngineConfig
    from tests.dualpath.fast_config import FAST

    kv = QosPolicy().kv
    with in_process_engines(EngineConfig(str(tmp_path / "store"), **FAST)) as (pe, de):
        for engine in (pe, de):
            (link,) = engine.dataplane.links.values()  # the pair's communicator, made at the PE's hello
            resolved = link.comm.resolved
            assert (resolved["traffic_class"], resolved["service_level"]) == (kv.traffic_class, kv.service_level)
            assert resolved["origin"]["hcclRdmaServiceLevel"] == "config"  # HCCL_RDMA_SL cannot move it
            assert list(link.comm.device.nic.sl_weights) == QosPolicy().nic_sl_weights()


def test_the_connector_dataplane_communicator_is_in_the_kv_class(emu, monkeypatch):
    from ascend_dualpath.dualpath.dataplane import PE_RANK, open_dataplane
    from ascend_dualpath.dualpath.settings import ConnectorSettings

    monkeypatch.setenv("HCCL_RDMA_SL", "4")  # the model class's SL process-wide: the comm config must win
    settings = ConnectorSettings(
        role="kv_producer",
        store="unused",
        node="pe",
        snic_bytes_per_s=1e9,
        side_port=None,
        fabric=emu.new_fabric_name("qos"),
        timeout_s=5.0,
        hccl_buffer_mb=2,
        host_buffer_mb=2,
    )
    dataplane = open_dataplane(settings, PE_RANK, "emulator")
    try:
        kv = QosPolicy().kv
        resolved = dataplane.new_link("tcp://127.0.0.1:1", 1).comm.resolved
        assert (resolved["traffic_class"], resolved["service_level"]) == (kv.traffic_class, kv.service_level)
        assert list(dataplane.device.nic.sl_weights) == QosPolicy().nic_sl_weights()
    finally:
        dataplane.close()
