"""The ``aiv`` strategy's own properties: which dataplane moved the rows, exact placement in the receive windows
(poisoned around), bounded notify waits, and hypothesis-drawn shapes and dtypes on both dataplanes.

DeepEP conformance of ``aiv`` (both dataplanes, 2/4/8 ranks) is in ``test_moe_conformance.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.moe import _spawn

POISON = 0xA5
WAIT_S = 10
AICPU_ENV = {"ADP_EMU_CAPABILITY_BITMAP": "0"}


def _inputs(world: int, seed: int, tokens: list[int], hidden: int, topk: int, local_experts: int, dtype):
    g = torch.Generator().manual_seed(seed)
    experts = local_experts * world
    xs, idxs, weights = [], [], []
    for rank in range(world):
        scores = torch.rand(tokens[rank], experts, generator=g)
        idx = scores.topk(topk, dim=1).indices
        idx[torch.rand(tokens[rank], topk, generator=g) < 0.25] = -1
        xs.append((torch.randn(tokens[rank], hidden, generator=g) * 4).to(dtype))
        idxs.append(idx)
        weights.append(torch.rand(tokens[rank], topk, generator=g))
    return xs, idxs, weights, experts


def _dispatch(buffer, x, idx, w, experts):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    return buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )


def _packed_rows(receive, idxs, weights, xs) -> bytes:
    """The bytes the dispatch kernel must leave in the receive window: per received row, x | top-k ids (global,
    as sent) | weights | source index, back to back."""
    rows = []
    for src, t in zip(receive.src_rank, receive.src_idx, strict=True):
        rows += [
            xs[src][t].contiguous().view(torch.uint8).numpy().tobytes(),
            idxs[src][t].contiguous().view(torch.uint8).numpy().tobytes(),
            weights[src][t].contiguous().view(torch.uint8).numpy().tobytes(),
            np.int32(t).tobytes(),
        ]
    return b"".join(rows)


def _dataplane_worker(rank: int, world: int, env: dict) -> dict:
    """Dispatch, combine, low-latency dispatch and combine once each; report which dataplane moved the rows and
    whether the results are exact."""
    os.environ.update(env)
    from ascend_dualpath.moe import Buffer
    from ascend_dualpath.reference import moe as ref

    hidden, local_experts, max_tokens = 256, 2, 16
    buffer = Buffer(
        None,
        num_nvl_bytes=1 << 22,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, local_experts * world),
        low_latency_mode=True,
        strategy="aiv",
        timeout_s=WAIT_S,
    )
    xs, idxs, weights, experts = _inputs(world, 7, [9, 5, 0, 6][:world], hidden, 3, local_experts, torch.bfloat16)
    want = ref.dispatch(xs, idxs, weights, experts)
    recv_x, _, _, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    combined, _, _ = buffer.combine(recv_x, handle)
    want_combined = ref.combine([r.x for r in want], want, [x.shape[0] for x in xs])[rank]
    ll_x, ll_count, ll_handle, _, _ = buffer.low_latency_dispatch(
        xs[rank], idxs[rank], max_tokens, experts, use_fp8=False
    )
    ll_out, _, _ = buffer.low_latency_combine(ll_x, idxs[rank], weights[rank], ll_handle)
    want_ll = [len(e.sources) for e in ref.low_latency_dispatch(idxs, experts)[rank]]
    want_ll_out = ref.low_latency_combine(lambda t, e: xs[rank][t], idxs[rank], weights[rank])
    strategy = buffer.strategy
    comm = strategy.comm
    out = {
        "strategy": buffer.strategy_name,
        "dataplane": strategy.dataplane,
        "batch_write_issues": comm.batch_write_issues,
        "aiv_wqes_posted": sum(comm.aiv_qp(p).head for p in range(world)),
        "nic_wqes": strategy.device.nic.wqes_executed,
        "dispatch_exact": torch.equal(recv_x.view(torch.int16), want[rank].x.view(torch.int16)),
        "combine_exact": torch.equal(combined.view(torch.int16), want_combined.view(torch.int16)),
        "ll_counts": ll_count.tolist() == want_ll,
        "ll_combine": want_ll_out is None or ref.calc_diff(ll_out, want_ll_out) < 1e-5,
    }
    buffer.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("env, dataplane", [({}, "aiv"), (AICPU_ENV, "aicpu")], ids=["aiv", "aicpu"])
def test_rows_move_on_the_selected_dataplane(env: dict, dataplane: str) -> None:
    world = 4
    results = _spawn.run_ranks(world, _dataplane_worker, env)
    for result in results:
        assert "__fatal__" not in result, result["__fatal__"]
        assert result["strategy"] == "aiv" and result["dataplane"] == dataplane, result
        assert result["dispatch_exact"] and result["combine_exact"], result
        assert result["ll_counts"] and result["ll_combine"], result
        # every peer got at least its notify WQE over the NIC, in each of the four ops
        assert result["nic_wqes"] >= 4 * (world - 1), result
        if dataplane == "aiv":
            assert result["batch_write_issues"] == 0, result
            assert result["aiv_wqes_posted"] >= 4 * (world - 1), result
        else:
            assert result["batch_write_issues"] == 4, result  # one BatchWrite per op, from core 0
            assert result["aiv_wqes_posted"] == 0, result


def _poison_worker(rank: int, world: int, env: dict) -> dict:
    """After a warm-up dispatch, poison both receive-window halves, dispatch again (same shapes): the used half
    holds exactly the packed rows and poison after them; the other half stays poisoned."""
    os.environ.update(env)
    from ascend_dualpath.moe import Buffer
    from ascend_dualpath.reference import moe as ref

    buffer = Buffer(None, num_nvl_bytes=1 << 22, strategy="aiv", timeout_s=WAIT_S)
    local_experts = 2
    xs, idxs, weights, experts = _inputs(world, 11, [7, 4, 8][:world], 128, 2, local_experts, torch.bfloat16)
    _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    strategy = buffer.strategy
    window = np.frombuffer(strategy.comm.windows_in, dtype=np.uint8)
    half_bytes = window.size // 2 // 4096 * 4096
    window[:] = POISON
    used = (strategy._epoch + 1) % 2  # the half the next op writes
    recv_x, *_ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    want = ref.dispatch(xs, idxs, weights, experts)[rank]
    packed = _packed_rows(want, idxs, weights, xs)
    half = window[used * half_bytes : (used + 1) * half_bytes]
    other = window[(1 - used) * half_bytes : (2 - used) * half_bytes]
    out = {
        "rows": "ok" if half[: len(packed)].tobytes() == packed else "packed rows differ",
        "after": "ok" if (half[len(packed) :] == POISON).all() else "written past the received rows",
        "other_half": "ok" if (other == POISON).all() else "the other half was written",
        "received": "ok" if torch.equal(recv_x.view(torch.int16), want.x.view(torch.int16)) else "recv_x differs",
    }
    buffer.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, AICPU_ENV], ids=["aiv", "aicpu"])
def test_dispatch_writes_exactly_the_received_rows_into_the_window(env: dict) -> None:
    for result in _spawn.run_ranks(3, _poison_worker, env):
        assert result == {"rows": "ok", "after": "ok", "other_half": "ok", "received": "ok"}, result


def _silent_peer_worker(rank: int, world: int, env: dict) -> dict:
    """Both ranks dispatch once; then only rank 0 runs a cached dispatch: its notify wait must time out, name
    rank 1, and end within the bound."""
    import time

    import torch.distributed as dist

    os.environ.update(env)
    from ascend_dualpath.errors import WaitTimeout
    from ascend_dualpath.moe import Buffer

    buffer = Buffer(None, num_nvl_bytes=1 << 20, strategy="aiv", timeout_s=2)
    xs, idxs, weights, experts = _inputs(world, 3, [4, 4], 64, 2, 2, torch.bfloat16)
    _, _, _, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    dist.barrier()
    if rank == 1:
        time.sleep(3)  # past rank 0's bound (2 s): rank 0 must give up on its own
        buffer.destroy()
        return {"peer": "ok"}
    start = time.monotonic()
    try:
        buffer.dispatch(xs[rank], handle=handle)
    except WaitTimeout as exc:
        message = str(exc)
        return {
            "timeout": "ok" if "no notify" in message and "rank(s) [1]" in message else message,
            "elapsed": "ok" if time.monotonic() - start < 4.5 else f"took {time.monotonic() - start:.1f} s",
        }
    finally:
        buffer.destroy()
    return {"timeout": "the cached dispatch returned although rank 1 never sent"}


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, AICPU_ENV], ids=["aiv", "aicpu"])
def test_notify_wait_is_bounded_and_names_the_silent_rank(env: dict) -> None:
    results = _spawn.run_ranks(2, _silent_peer_worker, env, timeout_s=60)
    assert results[0] == {"timeout": "ok", "elapsed": "ok"}, results


def _bad_remote_worker(rank: int, world: int, env: dict) -> dict:
    """Rank 0's table points its block for rank 1 past rank 1's receive window: rank 0 gets the dataplane's bounds
    error (a failed WQE, or the AICPU server rejecting the item), nothing lands at rank 1, whose wait for rank 0's
    notify ends in WaitTimeout; the queues stay usable for the peers' next op."""
    import torch.distributed as dist

    os.environ.update(env)
    from ascend_dualpath.errors import BoundsError, NotRegistered, WaitTimeout
    from ascend_dualpath.moe import Buffer

    buffer = Buffer(None, num_nvl_bytes=1 << 20, strategy="aiv", timeout_s=2)
    xs, idxs, weights, experts = _inputs(world, 5, [6, 6], 64, 2, 2, torch.bfloat16)
    idxs = [torch.full_like(i, -1) for i in idxs]
    idxs[0][:, 0] = 2  # every token of rank 0 goes to rank 1 only: rank 0 receives nothing
    _, _, _, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    strategy = buffer.strategy
    window = np.frombuffer(strategy.comm.windows_in, dtype=np.uint8)
    window[:] = POISON
    dist.barrier()
    out = {}
    if rank == 0:
        good = strategy._peer_in[1]
        strategy._peer_in[1] = type(good)(good.addr + good.size, good.size, good.rkey)
        try:
            buffer.dispatch(xs[rank], handle=handle)
            out["sender"] = "the dispatch into an unregistered range returned"
        except (BoundsError, NotRegistered) as exc:
            # the NIC's completion names the check; the AICPU server names the peer whose memory it is not
            words = "REMOTE_OUT_OF_BOUNDS" if strategy.dataplane == "aiv" else "rank 1 registered"
            out["sender"] = "ok" if words in str(exc) else str(exc)
        strategy._peer_in[1] = good
        out["queues"] = (
            "ok"
            if all(strategy.comm.aiv_qp(p).state.name == "READY_TO_SEND" for p in range(world))
            else "a queue pair stayed in ERROR"
        )
    else:
        try:
            buffer.dispatch(xs[rank], handle=handle)
            out["receiver"] = "returned without rank 0's rows"
        except WaitTimeout as exc:
            out["receiver"] = "ok" if "rank(s) [0]" in str(exc) else str(exc)
        out["window"] = "ok" if (window == POISON).all() else "rows landed although the sender failed"
    buffer.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, AICPU_ENV], ids=["aiv", "aicpu"])
def test_a_bad_remote_address_fails_on_the_sender_and_times_out_the_receiver(env: dict) -> None:
    sender, receiver = _spawn.run_ranks(2, _bad_remote_worker, env, timeout_s=60)
    assert sender == {"sender": "ok", "queues": "ok"}, sender
    assert receiver == {"receiver": "ok", "window": "ok"}, receiver


def _hierarchy_worker(rank: int, world: int, env: dict, ranks_per_node: int) -> dict:
    """The two-hop (hierarchy) routes: dispatch, cached dispatch (FP8) and combine equal the references bitwise,
    and RDMA goes only to the same-index rank of other nodes and to ranks of this node."""
    os.environ.update(env)
    from ascend_dualpath.moe import Buffer, quant
    from ascend_dualpath.reference import moe as ref

    buffer = Buffer(None, num_nvl_bytes=1 << 22, strategy="aiv", ranks_per_node=ranks_per_node, timeout_s=WAIT_S)
    tokens = [11, 3, 0, 8, 6, 1, 9, 4][:world]
    xs, idxs, weights, experts = _inputs(world, 21, tokens, 256, 4, 2, torch.bfloat16)
    want = ref.dispatch(xs, idxs, weights, experts)
    recv_x, recv_idx, recv_w, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    fp8 = [quant.per_token_cast_to_fp8(x) for x in xs]
    cached = buffer.dispatch(fp8[rank], handle=handle)[0]
    want_fp8 = ref.dispatch(fp8, idxs, None, experts)[rank].x
    bias = torch.randn(tokens[rank], 256, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    combined, combined_w, _ = buffer.combine(recv_x, handle, recv_w, bias=bias)
    biases = [
        (torch.randn(t, 256, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16), None)
        for r, t in enumerate(tokens)
    ]
    want_combined = ref.combine([r.x for r in want], want, tokens, biases)[rank]
    strategy = buffer.strategy
    node, local = rank // ranks_per_node, rank % ranks_per_node
    allowed = {p for p in range(world) if p // ranks_per_node == node or p % ranks_per_node == local}
    posted = {p for p in range(world) if strategy.comm.aiv_qp(p).head}
    out = {
        "dispatch": torch.equal(recv_x.view(torch.int16), want[rank].x.view(torch.int16))
        and torch.equal(recv_idx, want[rank].topk_idx)
        and torch.equal(recv_w, want[rank].topk_weights),
        "cached_fp8": all(
            torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(cached, want_fp8, strict=True)
        ),
        "combine": torch.equal(combined.view(torch.int16), want_combined.view(torch.int16))
        and torch.equal(combined_w, torch.where(idxs[rank] >= 0, weights[rank], 0.0)),
        "routes": posted <= allowed - {rank} if strategy.dataplane == "aiv" else True,
        "two_hop": strategy.hierarchy,  # Buffer passes its ranks_per_node to the aiv strategy
    }
    buffer.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "env, world, ranks_per_node",
    [({}, 4, 2), (AICPU_ENV, 4, 2), ({}, 8, 2), (AICPU_ENV, 8, 4)],
    ids=["aiv-R4-P2", "aicpu-R4-P2", "aiv-R8-P2", "aicpu-R8-P4"],
)
def test_hierarchy_routes_match_the_reference(env: dict, world: int, ranks_per_node: int) -> None:
    for result in _spawn.run_ranks(world, _hierarchy_worker, env, ranks_per_node):
        assert result == {"dispatch": True, "cached_fp8": True, "combine": True, "routes": True, "two_hop": True}, (
            result
        )


# Every GM -> UB copy of rank 0's cores takes this much longer (emulator: ADP_EMU_MTE2_STALL_US).
SLOW_RECEIVER_STALL_US = 4000


def _slow_receiver_worker(rank: int, world: int, env: dict) -> dict:
    """R=4, P=2 (nodes {0, 1} and {2, 3}). Every token goes to rank 0, whose vector cores read GM slowly, so its
    unpack of hop 2 is long; relay 1 forwards the rows of sources 1 and 3 to it. Relay 1 returns from hop 2 as soon
    as rank 0 has posted its notify, runs hop 1 of the next dispatch (which does not link it with rank 0) at full
    speed, and writes the next hop 2 into rank 0's window while rank 0 is still unpacking: on the old code, with
    one pair of halves shared by all routes, into the half being unpacked. Each dispatch must equal the
    reference bitwise."""
    os.environ.update(env)
    if rank == 0:
        os.environ["ADP_EMU_MTE2_STALL_US"] = str(SLOW_RECEIVER_STALL_US)
    from ascend_dualpath.moe import Buffer
    from ascend_dualpath.reference import moe as ref

    buffer = Buffer(None, num_nvl_bytes=1 << 22, strategy="aiv", ranks_per_node=2, timeout_s=WAIT_S)
    tokens = [1, 6, 0, 6]
    xs, idxs, weights, experts = _inputs(world, 31, tokens, 64, 1, 2, torch.bfloat16)
    idxs = [torch.zeros_like(i) for i in idxs]  # expert 0: rank 0
    failures = []
    recv_x, _, _, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
    outputs = [(recv_x, xs)]
    for step in range(1, 4):  # cached dispatches: no collective between them, each with new values
        step_xs = [x + step for x in xs]
        outputs.append((buffer.dispatch(step_xs[rank], handle=handle)[0], step_xs))
    for step, (got, step_xs) in enumerate(outputs):
        want = ref.dispatch(step_xs, idxs, weights, experts)[rank].x
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            failures.append(f"dispatch {step}: {int((got != want).any(dim=1).sum())} of {want.shape[0]} rows differ")
    buffer.destroy()
    return {"failures": failures}


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, AICPU_ENV], ids=["aiv", "aicpu"])
def test_hierarchy_relay_never_overwrites_rows_a_slow_receiver_still_unpacks(env: dict) -> None:
    for rank, result in enumerate(_spawn.run_ranks(4, _slow_receiver_worker, env)):
        assert result == {"failures": []}, f"rank {rank}: {result}"


def _property_worker(rank: int, world: int, env: dict) -> dict:
    """Hypothesis draws shapes, dtypes and routing; both ranks draw the same examples (derandomised), so their
    collectives pair up. Dispatch must equal the reference bitwise, combine the fixed-order reference bitwise."""
    os.environ.update(env)
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ascend_dualpath.moe import Buffer
    from ascend_dualpath.reference import moe as ref

    buffer = Buffer(None, num_nvl_bytes=1 << 24, strategy="aiv", timeout_s=WAIT_S)
    failures: list[str] = []

    @settings(max_examples=12, derandomize=True, database=None, deadline=None)
    @given(
        tokens=st.lists(st.integers(0, 24), min_size=world, max_size=world),
        hidden_blocks=st.integers(1, 24),
        topk=st.integers(1, 4),
        local_experts=st.integers(1, 4),
        dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
        seed=st.integers(0, 2**16),
    )
    def example(tokens, hidden_blocks, topk, local_experts, dtype, seed):
        hidden = hidden_blocks * 16  # rows stay multiples of 16 bytes in every dtype
        topk = min(topk, local_experts * world)
        xs, idxs, weights, experts = _inputs(world, seed, tokens, hidden, topk, local_experts, dtype)
        want = ref.dispatch(xs, idxs, weights, experts)
        recv_x, recv_idx, recv_w, _, handle, _ = _dispatch(buffer, xs[rank], idxs[rank], weights[rank], experts)
        bias = (torch.randn(tokens[rank], hidden, generator=torch.Generator().manual_seed(seed + rank)).to(dtype), None)
        combined, combined_w, _ = buffer.combine(recv_x, handle, recv_w, bias=bias)
        biases = [
            (torch.randn(tokens[r], hidden, generator=torch.Generator().manual_seed(seed + r)).to(dtype), None)
            for r in range(world)
        ]
        want_combined = ref.combine([r.x for r in want], want, tokens, biases)[rank]
        label = f"tokens={tokens} hidden={hidden} topk={topk} L={local_experts} {dtype} seed={seed}"
        if not torch.equal(recv_x.view(torch.uint8), want[rank].x.view(torch.uint8)):
            failures.append(f"{label}: recv_x differs")
        if not (torch.equal(recv_idx, want[rank].topk_idx) and torch.equal(recv_w, want[rank].topk_weights)):
            failures.append(f"{label}: recv top-k differs")
        if not torch.equal(combined.view(torch.uint8), want_combined.view(torch.uint8)):
            failures.append(f"{label}: combine differs from the fixed-order reference")
        masked = torch.where(idxs[rank] >= 0, weights[rank], 0.0)
        if not torch.equal(combined_w, masked):
            failures.append(f"{label}: combined weights differ")

    example()
    buffer.destroy()
    return {"failures": failures}


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, AICPU_ENV], ids=["aiv", "aicpu"])
def test_drawn_shapes_and_dtypes_match_the_reference(env: dict) -> None:
    for result in _spawn.run_ranks(2, _property_worker, env):
        assert result == {"failures": []}, result


def test_capability_bitmap_variable_is_validated(monkeypatch) -> None:
    from ascend_dualpath import _env

    monkeypatch.setenv("ADP_EMU_CAPABILITY_BITMAP", "0x04")
    assert _env.emu_capability_bitmap() == 4
    monkeypatch.setenv("ADP_EMU_CAPABILITY_BITMAP", "aiv")
    with pytest.raises(ValueError, match="'aiv'"):
        _env.emu_capability_bitmap()
    monkeypatch.setenv("ADP_EMU_CAPABILITY_BITMAP", str(1 << 32))
    with pytest.raises(ValueError, match="0xffffffff"):
        _env.emu_capability_bitmap()
