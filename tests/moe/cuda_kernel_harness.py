"""The ``cuda`` strategy's kernels under the Triton interpreter (CPU): R emulated ranks in one process.

Run as ``TRITON_INTERPRET=1 python -m tests.moe.cuda_kernel_harness R``; prints ``ok`` or raises. Each rank is a
:class:`CudaStrategy` whose symmetric buffer is a CPU tensor (peers reach it through its address, as on the
GPU). One process runs kernels one after another, so the kernels that wait for peers (receive, reduce) are
queued and run after every rank has issued its send kernels; the count exchange, which sends and waits in one
kernel, is checked for its timeout on the first rank and for its data on the last.
"""

from __future__ import annotations

import os
import sys

import torch

from ascend_dualpath.errors import WaitTimeout
from ascend_dualpath.moe import quant
from ascend_dualpath.moe.config import Config
from ascend_dualpath.moe.strategies import cuda as cuda_strategy
from ascend_dualpath.moe.strategies.base import NormalPlan
from ascend_dualpath.reference import moe as ref
from tests.moe.conformance_worker import HIDDEN, make_inputs

BUFFER_BYTES = cuda_strategy.DATA_OFFSET + (4 << 20)
POISON = 0xAB
WAITING_KERNELS = ("receive_rows", "reduce_rows")


class _Queued:
    """A kernel whose waiting launches (the receive halves) are queued; the others run at once."""

    def __init__(self, kernel, queue: list, always: bool) -> None:
        self.kernel, self.queue, self.always = kernel, queue, always

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.always or (kwargs.get("RECEIVE") and not kwargs.get("SEND", True)):
                self.queue.append((self.kernel, grid, args, kwargs))
            else:
                self.kernel[grid](*args, **kwargs)

        return launch


class _Kernels:
    """The kernel module, with the waiting kernels (and receive-only launches) queued instead of launched."""

    def __init__(self, kernels, queue: list) -> None:
        self.kernels, self.queue = kernels, queue

    def __getattr__(self, name):
        kernel = getattr(self.kernels, name)
        return _Queued(kernel, self.queue, name in WAITING_KERNELS) if callable(kernel) else kernel


class EmulatedRank(cuda_strategy.CudaStrategy):
    """A CudaStrategy without process group or GPU: its buffer is ``buffers[rank]``, peers by address."""

    def __init__(self, rank: int, world: int, buffers: list[torch.Tensor], queue: list, num_sms: int = 3) -> None:
        self.group, self.timeout_s, self.rank, self.world = None, 1.0, rank, world
        self.device, self.device_sms, self.fixed_num_sms = torch.device("cpu"), 8, num_sms
        self.kernels = _Kernels(cuda_strategy._kernels(), queue)
        self.timeout_ns = int(1e9)
        self._epoch = self._count_epoch = self._generation = 0
        self._layout_sites, self._layout_ranges, self._sites, self._count_sites, self._plan_sites = {}, {}, {}, {}, {}
        self._source_index, self._fresh_matrix = {}, None
        self.fused = False  # one process runs the ranks in turn: the waiting halves must be separate launches
        local = buffers[rank]
        peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        self._symm = (local, None, peers, local[: cuda_strategy.HEADER_BYTES].view(torch.int32))

    def _buffer(self, half_bytes: int):
        assert cuda_strategy.DATA_OFFSET + 2 * half_bytes <= self._symm[0].numel(), "harness buffer too small"
        return self._symm


def _buffers(world: int) -> list[torch.Tensor]:
    buffers = [torch.full((BUFFER_BYTES,), POISON, dtype=torch.uint8) for _ in range(world)]
    for b in buffers:
        b[: cuda_strategy.HEADER_BYTES] = 0
    return buffers


def _flush(queue: list) -> None:
    while queue:
        kernel, grid, args, kwargs = queue.pop(0)
        kernel[grid](*args, **kwargs)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def check_layout(world: int) -> None:
    queue: list = []
    rank = EmulatedRank(0, world, _buffers(world), queue)
    _, idxs, _, experts = make_inputs(world, seed=3)
    for ranks_per_node in (8, 1):
        for idx in idxs:
            layout, host_range = rank.dispatch_layout(idx, experts, world, ranks_per_node)
            assert host_range is None, "the layout leaves the id range on the device (no host sync)"
            below, above = rank.layout_range(layout[3]).tolist()
            low, high = -below, above
            want = ref.dispatch_layout(idx, experts, world, ranks_per_node)
            for got, exp in zip(layout, want, strict=True):
                assert (got is None) == (exp is None) and (exp is None or torch.equal(got, exp)), (got, exp)
            # The range is clamped at 0 on both sides: enough to check ids against [-1, num_experts).
            want_range = (min(0, int(idx.min())), max(0, int(idx.max()))) if idx.numel() else (0, 0)
            assert (low, high) == want_range, ((low, high), want_range)
    bad = idxs[0].clone()
    bad[1, 0], bad[2, 1] = experts + 5, -7
    layout, _ = rank.dispatch_layout(bad, experts, world, 8)
    below, above = rank.layout_range(layout[3]).tolist()
    assert (-below, above) == (-7, experts + 5), (below, above)
    assert rank.layout_range(layout[3].clone()) is None, "the range belongs to the layout's own tensor"
    clean = bad.clone()
    clean[1, 0] = clean[2, 1] = -1
    want = ref.dispatch_layout(clean, experts, world, 8)
    assert torch.equal(layout[2], want[2]) and torch.equal(layout[3], want[3]), "out-of-range ids must count nowhere"


def check_count_exchange(world: int) -> None:
    queue: list = []
    buffers = _buffers(world)
    ranks = [EmulatedRank(r, world, buffers, queue) for r in range(world)]
    rows = [torch.arange(5, dtype=torch.int64) * 10 + r for r in range(world)]
    for r in range(world - 1):
        try:
            ranks[r].exchange_counts(rows[r], "test counts")
        except WaitTimeout as exc:
            assert "exceeded" in str(exc)
        else:
            raise AssertionError(f"rank {r} waited for peers that had not written, yet did not time out")
    matrix = ranks[-1].exchange_counts(rows[-1], "test counts")
    assert torch.equal(matrix, torch.stack(rows)), matrix

    # The fresh dispatch's exchange computes its statistics in the kernel: the same table as the host formula
    # (base class), with the layout's out-of-range ids folded into the id range.
    _, idxs, _, experts = make_inputs(world, seed=11)
    idxs[0] = idxs[0].clone()
    if idxs[0].shape[0] > 2:
        idxs[0][2, 0] = experts + 3  # out of range: counted nowhere by the layout, seen by the exchange
    layouts = [ranks[r].dispatch_layout(idxs[r], experts, world, 8)[0] for r in range(world)]
    for r in range(world):
        with_topk = r % 2 == 0  # odd ranks dispatch without top-k: their range comes from the layout only
        per_rank, _, per_expert, in_rank = layouts[r]
        topk = idxs[r] if with_topk else None
        try:
            table = ranks[r].exchange_dispatch_counts(per_rank, per_expert, topk, in_rank, "test dispatch counts")
        except WaitTimeout:
            assert r < world - 1
            continue
        rows_want = []
        for q in range(world):
            idx = idxs[q]
            low = int(idx.min()) if q % 2 == 0 and idx.numel() else -1
            high = int(idx.max()) if q % 2 == 0 and idx.numel() else -1
            below, above = ranks[q].layout_range(layouts[q][3]).tolist()
            low, high = min(low, -below), max(high, above)
            rows_want.append(
                torch.cat(
                    [
                        layouts[q][0].long(),
                        layouts[q][2].long(),
                        torch.tensor([low, high, int(layouts[q][0].sum()), int(layouts[q][3].sum())]),
                    ]
                )
            )
        assert torch.equal(table, torch.stack(rows_want)), (table, torch.stack(rows_want))
        if world > 1 and idxs[0].shape[0] > 2:
            assert int(table[0, world + experts + 1]) == experts + 3, "rank 0's bad id reaches every rank"


def _expected_tables(rank: int, in_rank: torch.Tensor, counts: torch.Tensor) -> dict:
    """The plan tables by the earlier host formulas (torch on the count matrix): the kernel must match them."""
    position = in_rank.to(torch.int64).cumsum(dim=0) - 1
    slots = torch.where(in_rank, position + counts[:rank].sum(dim=0), -1)
    gather = torch.where(in_rank, position + torch.cumsum(counts[rank], 0) - counts[rank], -1)
    gather[:, rank] = slots[:, rank]
    received = counts[:, rank]
    return dict(
        dispatch_slots=slots,
        gather_rows=gather,
        recv_prefix_dev=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(received, 0)]),
        slot_base_dev=counts[:, :rank].sum(dim=1),
        rank_prefix_matrix=counts.cumsum(dim=0),
    )


def _plans(ranks, idxs, experts, layouts):
    world = len(ranks)
    count_matrix = torch.stack([layout[0].to(torch.int64) for layout in layouts])
    plans = []
    for r, strategy in enumerate(ranks):
        plan = NormalPlan(
            r,
            layouts[r][3],
            count_matrix,
            private={"config": Config(), "num_experts": experts, "num_topk": idxs[r].shape[1]},
        )
        strategy.prepare_plan(plan)
        for name, want in _expected_tables(r, layouts[r][3], count_matrix).items():
            got = plan.private[name]
            assert got.dtype == torch.int32 and torch.equal(got.long(), want), (r, name, got, want)
        plans.append(plan)
    assert all(p.num_recv_tokens >= 0 for p in plans) and world == len(plans)
    return plans


def check_dispatch_and_combine(world: int) -> None:
    queue: list = []
    buffers = _buffers(world)
    ranks = [EmulatedRank(r, world, buffers, queue) for r in range(world)]
    xs, idxs, weights, experts = make_inputs(world)
    layouts = [ranks[0].dispatch_layout(idx, experts, world, 8)[0] for idx in idxs]
    plans = _plans(ranks, idxs, experts, layouts)
    expected = ref.dispatch(xs, idxs, weights, experts)

    # Dispatch with every part Buffer sends on a fresh dispatch (x, top-k ids, weights, source index).
    received = []
    for r, strategy in enumerate(ranks):
        payload = [xs[r], idxs[r], weights[r], torch.arange(xs[r].shape[0], dtype=torch.int32)]
        received.append(strategy.dispatch_rows(plans[r], payload, "test dispatch"))
    _flush(queue)
    for r, (recv_x, recv_idx, recv_w, recv_src) in enumerate(received):
        want = expected[r]
        assert torch.equal(_bits(recv_x), _bits(want.x)), f"rank {r}: x rows"
        assert torch.equal(recv_src, torch.tensor(want.src_idx, dtype=torch.int32)), f"rank {r}: source index"
        local = experts // world
        here = (recv_idx >= r * local) & (recv_idx < (r + 1) * local)
        assert torch.equal(torch.where(here, recv_idx - r * local, -1), want.topk_idx), f"rank {r}: top-k ids"
        assert torch.equal(torch.where(here, recv_w, 0.0), want.topk_weights), f"rank {r}: weights"

    # FP8 (values, scales): two parts of different widths.
    fp8 = [quant.per_token_cast_to_fp8(x) for x in xs]
    want_fp8 = ref.dispatch(fp8, idxs, None, experts)
    received = [strategy.dispatch_rows(plans[r], list(fp8[r]), "test fp8") for r, strategy in enumerate(ranks)]
    _flush(queue)
    for r, parts in enumerate(received):
        for got, exp in zip(parts, want_fp8[r].x, strict=True):
            assert torch.equal(_bits(got), _bits(exp)), f"rank {r}: fp8 part"

    # Combine with both biases and the weights part, against the fixed-order float32 reference.
    g = torch.Generator().manual_seed(7)
    biases = [
        (
            torch.randn(x.shape[0], HIDDEN, generator=g).to(torch.bfloat16),
            torch.ones(x.shape[0], HIDDEN, dtype=torch.bfloat16),
        )
        for x in xs
    ]
    combined = [
        strategy.combine_rows(plans[r], expected[r].x, expected[r].topk_weights, biases[r])
        for r, strategy in enumerate(ranks)
    ]
    _flush(queue)
    want = ref.combine([e.x for e in expected], expected, [x.shape[0] for x in xs], biases)
    for r, (out, out_w) in enumerate(combined):
        assert torch.equal(_bits(out), _bits(want[r])), f"rank {r}: combine differs from the reference"
        assert out_w.shape == weights[r].shape
    # Launch sites are cached per plan, part layout and data half: two more dispatches of new data use the
    # other half, then the cached site of the first of them (with other input and output tensors).
    for round_ in range(3):
        sites_before = [len(strategy._sites) for strategy in ranks]
        new_xs = [torch.randn(x.shape, generator=g).to(torch.bfloat16) for x in xs]
        received = [
            strategy.dispatch_rows(plans[r], [new_xs[r]], "test cached site")[0] for r, strategy in enumerate(ranks)
        ]
        _flush(queue)
        want_new = ref.dispatch(new_xs, idxs, None, experts)
        for r, got in enumerate(received):
            assert torch.equal(_bits(got), _bits(want_new[r].x)), f"rank {r}: cached-site dispatch {round_}"
        if round_ == 2:
            assert [len(strategy._sites) for strategy in ranks] == sites_before, "the third reused a site"
    for r, (strategy, b) in enumerate(zip(ranks, buffers, strict=True)):
        header = b[: cuda_strategy.HEADER_BYTES].view(torch.int32)
        assert int(header[cuda_strategy._kernels().ERROR_WORD]) == 0
        assert int(header[cuda_strategy._kernels().EPOCH_WORD]) == strategy.data_epoch == 6, "device epoch"
        assert bool((b[-4096:] == POISON).all()), f"rank {r}: bytes past the used regions were written"


def check_fused_launches(world: int) -> None:
    """The one-launch dispatch and combine (the GPU path). Ranks run in turn, so only the last rank finds every
    peer's rows in place (the others time out waiting, which sets their error word): check that rank."""
    queue: list = []
    buffers = _buffers(world)
    ranks = [EmulatedRank(r, world, buffers, queue) for r in range(world)]
    for strategy in ranks:
        strategy.fused = True
    xs, idxs, weights, experts = make_inputs(world, seed=5)
    xs[-1] = torch.randn(6, HIDDEN).to(torch.bfloat16)  # the last rank needs tokens to check the combine
    idxs[-1] = torch.randint(0, experts, (6, idxs[0].shape[1]))
    weights[-1] = torch.rand(6, idxs[0].shape[1])
    layouts = [ranks[0].dispatch_layout(idx, experts, world, 8)[0] for idx in idxs]
    plans = _plans(ranks, idxs, experts, layouts)
    expected = ref.dispatch(xs, idxs, weights, experts)
    received = [strategy.dispatch_rows(plans[r], [xs[r]], "fused dispatch")[0] for r, strategy in enumerate(ranks)]
    assert not queue, "fused launches queue nothing"
    last = world - 1
    assert torch.equal(_bits(received[last]), _bits(expected[last].x)), "fused dispatch rows (last rank)"
    combined = [strategy.combine_rows(plans[r], expected[r].x, None, ())[0] for r, strategy in enumerate(ranks)]
    want = ref.combine([e.x for e in expected], expected, [x.shape[0] for x in xs], [() for _ in xs])
    assert torch.equal(_bits(combined[last]), _bits(want[last])), "fused combine (last rank)"
    assert int(buffers[last][: cuda_strategy.HEADER_BYTES].view(torch.int32)[cuda_strategy._kernels().ERROR_WORD]) == 0
    assert int(buffers[0][: cuda_strategy.HEADER_BYTES].view(torch.int32)[cuda_strategy._kernels().ERROR_WORD]) == 1


def check_localize_topk(world: int) -> None:
    """Received global ids become local ids (-1 for other ranks' experts), -1 slots get weight 0, in place."""
    rank = EmulatedRank(world - 1, world, _buffers(world), [])
    g = torch.Generator().manual_seed(world)
    local = 4
    ids = torch.randint(-1, local * world, (37, 5), generator=g)
    weights = torch.rand(37, 5, generator=g)
    want_ids = torch.where((ids >= rank.rank * local) & (ids < (rank.rank + 1) * local), ids - rank.rank * local, -1)
    want_weights = torch.where(want_ids >= 0, weights, 0.0)
    got_ids, got_weights = rank.localize_topk(ids, weights, rank.rank, local)
    assert got_ids is ids and got_weights is weights, "the cuda strategy localises in place"
    assert torch.equal(ids, want_ids) and torch.equal(_bits(weights), _bits(want_weights))


LL_MAX_TOKENS = 16


def check_low_latency(world: int) -> None:
    """Low-latency dispatch (BF16, FP8, FP8 with power-of-two scales, UE8M0) and weighted combine, send halves
    first on every rank, then the receive halves: packed rows bit-exact (FP8 against ``quant``), counts, ranges,
    source info, stats, rows past the counts untouched (zero), message rows never sent still poisoned; the
    combine bit-exact against the float32 slot-order sum."""
    xs, idxs, weights, experts = make_inputs(world, seed=9)
    local = experts // world
    slab = world * LL_MAX_TOKENS
    sources = ref.low_latency_dispatch(idxs, experts)
    for use_fp8, round_scale, use_ue8m0 in [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ]:
        queue: list = []
        buffers = _buffers(world)
        ranks = [EmulatedRank(r, world, buffers, queue) for r in range(world)]
        stats = [torch.full((local,), 5, dtype=torch.int32) for _ in range(world)]
        outs = [
            strategy.ll_dispatch(
                xs[r], idxs[r], LL_MAX_TOKENS, experts, use_fp8, round_scale, use_ue8m0, stats[r], True
            )
            for r, strategy in enumerate(ranks)
        ]
        assert all(int(out[1].sum()) == 0 for out in outs), "the receive half ran before it was called"
        for out in outs:
            out[4]()
        _flush(queue)
        for r, (recv_x, recv_count, src_info, layout_range, _) in enumerate(outs):
            values = recv_x[0] if use_fp8 else recv_x
            assert values.shape == (local, slab, HIDDEN)
            for expert in range(local):
                want = sources[r][expert].sources  # (source rank, token) in source order, ascending token
                count = int(recv_count[expert])
                assert count == len(want) and int(stats[r][expert]) == 5 + count, (r, expert, count, len(want))
                begins = (layout_range[expert] >> 32).tolist()
                counts = (layout_range[expert] & 0xFFFFFFFF).tolist()
                got = [
                    (src, int(src_info[expert, begins[src] + i])) for src in range(world) for i in range(counts[src])
                ]
                assert got == want, (r, expert, got, want)
                assert bool((src_info[expert, count:] == -1).all())
                for row, (src, t) in enumerate(want):
                    if use_fp8:
                        q, scales = quant.per_token_cast_to_fp8(xs[src][t : t + 1], round_scale, use_ue8m0)
                        assert torch.equal(_bits(values[expert, row]), _bits(q[0])), (r, expert, row, "fp8 values")
                        assert torch.equal(_bits(recv_x[1][expert, row]), _bits(scales[0])), (r, expert, row)
                    else:
                        assert torch.equal(_bits(values[expert, row]), _bits(xs[src][t])), (r, expert, row)
                assert bool((_bits(values[expert, count:]) == 0).all()), "rows past the count stay zero"
                if use_fp8:
                    assert bool((_bits(recv_x[1][expert, count:]) == 0).all())
            # Message rows no source sent (j >= count of that source) keep the poison.
            assert (
                int(buffers[r][: cuda_strategy.HEADER_BYTES].view(torch.int32)[cuda_strategy._kernels().ERROR_WORD])
                == 0
            )
            half = ranks[r]._half(ranks[r].data_epoch % 2)
            value_words = HIDDEN // 4 if use_fp8 else HIDDEN // 2
            region = buffers[r][half : half + experts * LL_MAX_TOKENS * value_words * 4].view(
                local, world, LL_MAX_TOKENS, value_words * 4
            )
            for expert in range(local):
                for src in range(world):
                    n = int(layout_range[expert, src] & 0xFFFFFFFF)
                    assert bool((region[expert, src, n:] == POISON).all()), (r, expert, src, "unsent rows written")
        if use_fp8:
            continue
        # Weighted combine of "expert outputs" that differ per expert (row x scaled by 1 + l/4, in bf16).
        factors = (1 + torch.arange(local, dtype=torch.float32) / 4).view(local, 1, 1)
        expert_x = [(out[0].float() * factors).to(torch.bfloat16) for out in outs]
        results = [torch.full((xs[r].shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16) for r in range(world)]
        receives = [
            strategy.ll_combine(expert_x[r], idxs[r], weights[r], outs[r][3], LL_MAX_TOKENS, experts, results[r], True)
            for r, strategy in enumerate(ranks)
        ]
        for receive in receives:
            receive()
        _flush(queue)
        for r in range(world):
            idx, w = idxs[r], weights[r]
            acc = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float32)
            for slot in range(idx.shape[1]):
                e = idx[:, slot]
                rows = (xs[r].float() * (1 + (e.clamp(min=0) % local).float() / 4).unsqueeze(1)).to(torch.bfloat16)
                rows = torch.where((e >= 0).unsqueeze(1), rows.float(), 0.0)
                acc = acc + torch.where(e >= 0, w[:, slot], 0.0).unsqueeze(1) * rows
            assert torch.equal(_bits(results[r]), _bits(acc.to(torch.bfloat16))), f"rank {r}: LL combine"
            if idx.shape[0]:
                x_r = xs[r]
                want64 = ref.low_latency_combine(
                    lambda t, e, x_r=x_r: (x_r[t].float() * (1 + (e % local) / 4)).to(torch.bfloat16), idx, w
                )
                if want64 is not None:
                    assert ref.calc_diff(results[r], want64) < 1e-5


def main(world: int) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    check_layout(world)
    check_count_exchange(world)
    check_dispatch_and_combine(world)
    check_fused_launches(world)
    check_localize_topk(world)
    check_low_latency(world)
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]))
