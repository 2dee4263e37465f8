"""The conformance checks one rank runs (inside a spawned gloo process); mirrors DeepEP's own test suites.

Every rank builds every rank's inputs from one seed, so each can compute the global reference
(:mod:`ascend_dualpath.reference.moe`) and compare its own outputs with it.

Value checks are soft (:meth:`Checks.expect` records and carries on), so a wrong value never leaves a check's
remaining collectives unpaired and every check reports. Only an exception (a timeout, a crash) may leave peers
inside a collective; after one, the ranks agree over a side gloo group to skip the remaining checks.
"""

from __future__ import annotations

import datetime
import traceback

import torch

from ascend_dualpath.errors import AlignmentError, BoundsError, CapacityError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe import Buffer, quant
from ascend_dualpath.reference import moe as ref

HIDDEN = 512  # a multiple of 512 so UE8M0 packing applies
TOPK = 4
EXPERTS_PER_RANK = 4
BASE_TOKENS = 12
LL_MAX_TOKENS = 16
REPEATS = 20
# Tolerances (DeepEP's test_low_latency.py): calc_diff of the weighted combine against the float64 reference.
LL_COMBINE_DIFF_BF16 = 1e-5
LL_COMBINE_DIFF_FP8 = 9e-4
# Normal combine of identity experts divided by the number of destinations, vs the source (DeepEP: 5e-6).
COMBINE_DIFF = 5e-6
NVL_BYTES = 1 << 24
# Bound of every collective wait: a rank that diverges makes its peers fail fast instead of hanging.
WAIT_S = 15
# Bound of the side-channel vote after each check (a peer may first sit out one WAIT_S timeout).
VOTE_S = 4 * WAIT_S
# Failed expectations kept per check (row loops could otherwise report hundreds).
MAX_REPORTED_FAILURES = 8


def make_inputs(world: int, seed: int = 0):
    """Unequal token counts (the last rank has none), random -1 slots and one all -1 row per rank."""
    g = torch.Generator().manual_seed(seed)
    experts = EXPERTS_PER_RANK * world
    xs, idxs, weights = [], [], []
    for rank in range(world):
        tokens = 0 if rank == world - 1 else BASE_TOKENS - rank
        scores = torch.rand(tokens, experts, generator=g)
        idx = scores.topk(TOPK, dim=1).indices
        idx[torch.rand(tokens, TOPK, generator=g) < 0.2] = -1
        if tokens:
            idx[0] = -1
        xs.append(torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16))
        idxs.append(idx)
        weights.append(torch.rand(tokens, TOPK, generator=g))
    return xs, idxs, weights, experts


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (a fresh dense copy, since a view's strides may not allow a dtype view)."""
    dense = torch.empty(t.shape, dtype=t.dtype)
    dense.copy_(t)
    return dense.view(torch.uint8)


def _layout_args(buffer: Buffer, idx: torch.Tensor, experts: int) -> dict:
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, experts)
    return dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )


class DeviceProxy:
    """Runs a Buffer on a GPU for CPU-side checks: tensor arguments go to the device, results come back.

    ``out=`` and ``cumulative_local_expert_recv_stats=`` are updated in place on the CPU, also when a returned
    hook runs the receive half later.
    """

    IN_PLACE = ("out", "cumulative_local_expert_recv_stats")

    def __init__(self, buffer: Buffer, device: torch.device) -> None:
        self.buffer, self.device = buffer, device

    def __getattr__(self, name):
        method = getattr(self.buffer, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            pairs = []
            dev_args = [self._to(a, self.device) for a in args]
            dev_kwargs = {}
            for key, value in kwargs.items():
                dev_kwargs[key] = self._to(value, self.device)
                if key in self.IN_PLACE and value is not None:
                    pairs.append((dev_kwargs[key], value))
            result = method(*dev_args, **dev_kwargs)
            if not isinstance(result, tuple):
                return result
            back = []
            for item in result:
                if callable(item) and not isinstance(item, torch.Tensor):
                    back.append(self._wrap_hook(item, pairs))
                else:
                    cpu = self._to(item, "cpu")
                    back.append(cpu)
                    for dev, host in zip(self._tensors(item), self._tensors(cpu), strict=True):
                        pairs.append((dev, host))
            for dev, host in pairs:
                host.copy_(dev.cpu())
            if "out" in kwargs and kwargs["out"] is not None:
                back[0] = kwargs["out"]
            return tuple(back)

        return call

    @staticmethod
    def _wrap_hook(hook, pairs):
        def run():
            hook()
            for dev, host in pairs:
                host.copy_(dev.cpu())

        return run

    @classmethod
    def _tensors(cls, value):
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, tuple):
            return [t for item in value for t in cls._tensors(item)]
        return []

    @classmethod
    def _to(cls, value, device):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, tuple):
            mapped = [cls._to(v, device) for v in value]
            return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)
        return value


class Checks:
    def __init__(self, rank: int, world: int, strategy: str = "alltoall", device: str = "cpu") -> None:
        self.rank, self.world = rank, world
        self.ranks_per_node = 2 if world >= 4 else 8  # R >= 4 exercises the internode (multi-node) layout
        self.buffer = Buffer(
            None,
            num_nvl_bytes=NVL_BYTES,
            num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(
                LL_MAX_TOKENS, HIDDEN, world, EXPERTS_PER_RANK * world
            ),
            low_latency_mode=True,
            strategy=strategy,
            ranks_per_node=self.ranks_per_node,
            timeout_s=WAIT_S,
        )
        if device != "cpu":
            self.buffer = DeviceProxy(self.buffer, torch.device(device))
        self.xs, self.idxs, self.weights, self.experts = make_inputs(world)
        self.expected = ref.dispatch(self.xs, self.idxs, self.weights, self.experts)
        self.mine = self.expected[rank]
        self.failures: list[str] = []
        self.num_failures = 0

    def expect(self, condition, message) -> None:
        """Record a failed expectation (the first few with their call site) and carry on."""
        if bool(condition):
            return
        self.num_failures += 1
        if len(self.failures) < MAX_REPORTED_FAILURES:
            site = traceback.extract_stack(limit=2)[0]
            self.failures.append(f"line {site.lineno} ({site.line}): {message}")

    def dispatch(self, x, **kwargs):
        args = _layout_args(self.buffer, self.idxs[self.rank], self.experts)
        args.update(topk_idx=self.idxs[self.rank], topk_weights=self.weights[self.rank])
        args.update(kwargs)
        return self.buffer.dispatch(x, **args)

    # ------------------------------------------------------------------ normal mode
    def check_layout(self) -> None:
        got = self.buffer.get_dispatch_layout(self.idxs[self.rank], self.experts)
        want = ref.dispatch_layout(self.idxs[self.rank], self.experts, self.world, self.ranks_per_node)
        names = ("per_rank", "per_rdma_rank", "per_expert", "is_token_in_rank")
        for name, g, w in zip(names, got[:4], want, strict=True):
            if w is None:
                self.expect(g is None, f"{name}: expected None on one node")
            else:
                self.expect(torch.equal(g, w), f"{name}: {g} != {w}")
        if self.world >= 4:
            self.expect(
                got[1] is not None and got[1].shape == (self.world // 2,),
                "got[1] is not None and got[1].shape == (self.world // 2,)",
            )

    def check_dispatch_bf16(self) -> None:
        recv_x, recv_idx, recv_w, counts, handle, event = self.dispatch(self.xs[self.rank])
        event.current_stream_wait()
        self.expect(recv_x.shape[0] == len(self.mine.src_idx), "recv_x.shape[0] == len(self.mine.src_idx)")
        self.expect(
            torch.equal(handle.rank_prefix_matrix, self.mine.rank_prefix_matrix),
            "torch.equal(handle.rank_prefix_matrix, self.mine.rank_prefix_matrix)",
        )
        prefix = [0] + handle.rank_prefix_matrix[:, self.rank].tolist()
        for row in range(recv_x.shape[0]):
            src = next(s for s in range(self.world) if prefix[s] <= row < prefix[s + 1])
            src_idx = int(handle.recv_src_idx[row])
            self.expect(torch.equal(_bits(recv_x[row]), _bits(self.xs[src][src_idx])), f"row {row} != source row")
        self.expect(torch.equal(_bits(recv_x), _bits(self.mine.x)), "receive order differs from (source, index) order")
        self.expect(torch.equal(recv_idx, self.mine.topk_idx), "torch.equal(recv_idx, self.mine.topk_idx)")
        self.expect(
            bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < EXPERTS_PER_RANK))).all()),
            "bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < EXPERTS_PER_RANK))).all())",
        )
        self.expect(torch.equal(recv_w, self.mine.topk_weights), "torch.equal(recv_w, self.mine.topk_weights)")
        self.expect(bool((recv_w[recv_idx == -1] == 0).all()), "bool((recv_w[recv_idx == -1] == 0).all())")
        self.expect(counts == self.mine.num_recv_tokens_per_expert, "counts == self.mine.num_recv_tokens_per_expert")
        self.expect(
            counts == [int((recv_idx == e).sum()) for e in range(EXPERTS_PER_RANK)],
            "counts == [int((recv_idx == e).sum()) for e in range(EXPERTS_PER_RANK)]",
        )
        global_counts = sum(ref.dispatch_layout(i, self.experts, self.world)[2] for i in self.idxs)
        self.expect(
            counts == global_counts[self.rank * EXPERTS_PER_RANK : (self.rank + 1) * EXPERTS_PER_RANK].tolist(),
            "counts == global_counts[self.rank * EXPERTS_PER_RANK:(self.rank + 1) * EXPERTS_PER_RANK].tolist()",
        )

    def check_expert_alignment(self) -> None:
        *_, counts, _, _ = self.dispatch(self.xs[self.rank], expert_alignment=4)
        want = ref.dispatch(self.xs, self.idxs, self.weights, self.experts, expert_alignment=4)[self.rank]
        self.expect(
            counts == want.num_recv_tokens_per_expert and all(c % 4 == 0 for c in counts),
            "counts == want.num_recv_tokens_per_expert and all(c % 4 == 0 for c in counts)",
        )

    def check_dispatch_quantised(self) -> None:
        variants = {
            "fp8 column-major scales": lambda x: (lambda q: (q[0], q[1].t().contiguous().t()))(
                quant.per_token_cast_to_fp8(x)
            ),
            "fp8 ue8m0": lambda x: quant.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True),
            "int8 per-token": quant.per_token_cast_to_int8,
        }
        for name, cast in variants.items():
            xs_q = [cast(x) for x in self.xs]
            want = ref.dispatch(xs_q, self.idxs, self.weights, self.experts)[self.rank]
            recv_x, *_ = self.dispatch(xs_q[self.rank])
            self.expect(isinstance(recv_x, tuple), name)
            for got, exp in zip(recv_x, want.x, strict=True):
                self.expect(got.dtype == exp.dtype and torch.equal(_bits(got), _bits(exp)), name)

    def check_worst_tokens(self) -> None:
        exact = self.dispatch(self.xs[self.rank])
        worst = BASE_TOKENS * self.world
        recv_x, recv_idx, recv_w, counts, _, _ = self.dispatch(self.xs[self.rank], num_worst_tokens=worst)
        n = exact[0].shape[0]
        self.expect(
            recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == worst,
            "recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == worst",
        )
        self.expect(counts == [], "counts == []")
        self.expect(torch.equal(_bits(recv_x[:n]), _bits(exact[0])), "torch.equal(_bits(recv_x[:n]), _bits(exact[0]))")
        self.expect(
            torch.equal(recv_idx[:n], exact[1]) and torch.equal(recv_w[:n], exact[2]),
            "torch.equal(recv_idx[:n], exact[1]) and torch.equal(recv_w[:n], exact[2])",
        )
        self.expect(
            bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all()),
            "bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all())",
        )

    def check_cached_dispatch(self) -> None:
        recv_x, _, _, _, handle, _ = self.dispatch(self.xs[self.rank])
        cached = self.buffer.dispatch(self.xs[self.rank], handle=handle)
        self.expect(cached[1:5] == (None, None, None, None), "cached[1:5] == (None, None, None, None)")
        self.expect(torch.equal(_bits(cached[0]), _bits(recv_x)), "torch.equal(_bits(cached[0]), _bits(recv_x))")
        for i in range(3):  # the same handle again, in both data halves (cuda: the launch sites' direct path)
            again = self.buffer.dispatch(self.xs[self.rank], handle=handle)[0]
            self.expect(torch.equal(_bits(again), _bits(recv_x)), f"cached dispatch repeated ({i + 2})")
        fp8 = quant.per_token_cast_to_fp8(self.xs[self.rank])
        cached_fp8 = self.buffer.dispatch(fp8, handle=handle)[0]
        want = ref.dispatch([quant.per_token_cast_to_fp8(x) for x in self.xs], self.idxs, None, self.experts)
        self.expect(
            all(torch.equal(_bits(g), _bits(w)) for g, w in zip(cached_fp8, want[self.rank].x, strict=True)),
            "all(torch.equal(_bits(g), _bits(w)) for g, w in zip(cached_fp8, want[self.rank].x, strict=True))",
        )

    def check_combine(self) -> None:
        recv_x, _, recv_w, _, handle, _ = self.dispatch(self.xs[self.rank])
        g = torch.Generator().manual_seed(100 + self.rank)
        tokens = self.xs[self.rank].shape[0]
        bias0 = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        bias1 = torch.ones(tokens, HIDDEN, dtype=torch.bfloat16)
        combined, combined_w, _ = self.buffer.combine(recv_x, handle, recv_w, bias=(bias0, bias1))
        biases = []
        for r in range(self.world):
            gr = torch.Generator().manual_seed(100 + r)
            t = self.xs[r].shape[0]
            biases.append(
                (torch.randn(t, HIDDEN, generator=gr).to(torch.bfloat16), torch.ones(t, HIDDEN, dtype=torch.bfloat16))
            )
        want = ref.combine([e.x for e in self.expected], self.expected, [x.shape[0] for x in self.xs], biases)
        self.expect(torch.equal(_bits(combined), _bits(want[self.rank])), "combine differs from fixed-order reference")
        masked = torch.where(self.idxs[self.rank] >= 0, self.weights[self.rank], 0.0)
        self.expect(torch.equal(combined_w, masked), "torch.equal(combined_w, masked)")
        self.expect(not bool(combined.isnan().any()), "not bool(combined.isnan().any())")
        # DeepEP's check: identity experts, no bias, divided by the number of destination ranks.
        plain, _, _ = self.buffer.combine(recv_x, handle)
        for i in range(3):  # repeated on the same handle, in both data halves
            again, _, _ = self.buffer.combine(recv_x, handle)
            self.expect(torch.equal(_bits(again), _bits(plain)), f"combine repeated ({i + 2})")
        in_rank = handle.is_token_in_rank.sum(dim=1, keepdim=True)
        routed = in_rank.squeeze(1) > 0
        if bool(routed.any()):
            diff = ref.calc_diff((plain.float() / in_rank.clamp(min=1))[routed], self.xs[self.rank].float()[routed])
            self.expect(diff < COMBINE_DIFF, diff)
        self.expect(bool((plain[~routed] == 0).all()), "a token routed nowhere must combine to zero")

    def check_weighted_combine(self) -> None:
        recv_x, _, recv_w, _, handle, _ = self.dispatch(self.xs[self.rank])
        combined, _, _ = self.buffer.combine(recv_x, handle, recv_w, weighted=True)
        # Σ over destination ranks of (Σ of that rank's weights) · x = (Σ of all valid weights) · x, in float64.
        masked = torch.where(self.idxs[self.rank] >= 0, self.weights[self.rank], 0.0).double()
        want = self.xs[self.rank].double() * masked.sum(dim=1, keepdim=True)
        # Each rank's scaled row is rounded to bf16 once and the sum once more: 2 bf16 ulps relative.
        self.expect(
            torch.allclose(combined.double(), want, rtol=2 * 2**-8, atol=1e-6),
            "torch.allclose(combined.double(), want, rtol=2 * 2 ** -8, atol=1e-6)",
        )

    def check_graph_replay(self) -> None:
        """cuda: cached dispatch + combine captured as CUDA graphs, replayed with new inputs (written in place)
        and interleaved with eager ops, bit-exact against the reference. Other strategies refuse to capture."""
        buffer = getattr(self.buffer, "buffer", self.buffer)  # the Buffer behind a DeviceProxy
        if buffer.strategy_name != "cuda":
            try:
                buffer.capture_graph(lambda: None)
            except ConfigError as exc:
                self.expect("cuda strategy" in str(exc), str(exc))
            else:
                self.expect(False, "capture_graph did not raise on a strategy without graphs")
            return
        device = torch.device("cuda", torch.cuda.current_device())
        idx, w = self.idxs[self.rank].to(device), self.weights[self.rank].to(device)
        static_x = self.xs[self.rank].to(device)
        layout = buffer.get_dispatch_layout(idx, self.experts)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            static_x,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=idx,
            topk_weights=w,
        )
        try:  # a fresh dispatch exchanges counts with a host sync: refused (after its eager warm-up run)
            buffer.capture_graph(
                lambda: buffer.dispatch(
                    static_x,
                    num_tokens_per_rank=layout[0],
                    is_token_in_rank=layout[3],
                    num_tokens_per_expert=layout[2],
                    topk_idx=idx,
                    topk_weights=w,
                )
            )
            self.expect(False, "capturing a fresh dispatch did not raise")
        except ConfigError as exc:
            self.expect("cached" in str(exc), str(exc))
        static_back = recv_x.clone()
        graph = buffer.capture_graph(
            lambda: (buffer.dispatch(static_x, handle=handle)[0], buffer.combine(static_back, handle)[0])
        )
        self.expect(graph.num_ops == 2, f"graph.num_ops == {graph.num_ops}")
        tokens = [x.shape[0] for x in self.xs]
        for round_ in range(4):
            g = torch.Generator().manual_seed(1000 + round_)
            xs = [torch.randn(x.shape, generator=g).to(torch.bfloat16) for x in self.xs]
            want = ref.dispatch(xs, self.idxs, None, self.experts)
            want_combined = ref.combine([e.x for e in want], want, tokens, [() for _ in xs])[self.rank]
            static_x.copy_(xs[self.rank])
            static_back.copy_(want[self.rank].x)
            got_x, got_combined = graph.replay()
            self.expect(torch.equal(_bits(got_x), _bits(want[self.rank].x)), f"replay {round_}: dispatch rows")
            self.expect(torch.equal(_bits(got_combined), _bits(want_combined)), f"replay {round_}: combine")
            if round_ % 2 == 0:  # one eager op flips the data half the next replay starts in
                eager = buffer.dispatch(static_x, handle=handle)[0]
                self.expect(torch.equal(_bits(eager), _bits(want[self.rank].x)), f"eager after replay {round_}")

    # ------------------------------------------------------------------ low latency
    def _ll(self, **kwargs):
        stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)
        out = self.buffer.low_latency_dispatch(
            self.xs[self.rank],
            self.idxs[self.rank],
            LL_MAX_TOKENS,
            self.experts,
            cumulative_local_expert_recv_stats=stats,
            **kwargs,
        )
        return out, stats

    def check_low_latency_dispatch(self) -> None:
        sources = ref.low_latency_dispatch(self.idxs, self.experts)[self.rank]
        for use_fp8, round_scale, use_ue8m0, hook_mode in [
            (False, False, False, False),
            (True, False, False, False),
            (True, True, False, True),
            (True, True, True, False),
        ]:
            (recv_x, recv_count, handle, _, hook), stats = self._ll(
                use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook_mode
            )
            if hook_mode:
                self.expect(int(recv_count.sum()) == 0, "receive half ran before hook()")
                hook()
            src_info, layout_range, max_tokens, hidden, experts = handle
            self.expect(
                (max_tokens, hidden, experts) == (LL_MAX_TOKENS, HIDDEN, self.experts),
                "(max_tokens, hidden, experts) == (LL_MAX_TOKENS, HIDDEN, self.experts)",
            )
            values = recv_x[0] if use_fp8 else recv_x
            self.expect(
                values.shape == (EXPERTS_PER_RANK, self.world * LL_MAX_TOKENS, HIDDEN),
                "values.shape == (EXPERTS_PER_RANK, self.world * LL_MAX_TOKENS, HIDDEN)",
            )
            if use_fp8:
                scales = recv_x[1]
                blocks = HIDDEN // 128 // (4 if use_ue8m0 else 1)
                self.expect(
                    scales.shape == (EXPERTS_PER_RANK, self.world * LL_MAX_TOKENS, blocks),
                    "scales.shape == (EXPERTS_PER_RANK, self.world * LL_MAX_TOKENS, blocks)",
                )
                self.expect(
                    scales.dtype == (torch.int32 if use_ue8m0 else torch.float32),
                    "scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)",
                )
                self.expect(scales.stride(1) == 1, "scales must be column-major in the last two dims")
            for expert in range(EXPERTS_PER_RANK):
                want = sources[expert].sources
                count = int(recv_count[expert])
                self.expect(count == len(want) == int(stats[expert]), "count == len(want) == int(stats[expert])")
                ranges = layout_range[expert]
                self.expect(int((ranges & 0xFFFFFFFF).sum()) == count, "int((ranges & 0xFFFFFFFF).sum()) == count")
                got = []
                for src in range(self.world):
                    begin, n = int(ranges[src] >> 32), int(ranges[src] & 0xFFFFFFFF)
                    for row in range(begin, begin + n):
                        t = int(src_info[expert, row])
                        got.append((src, t))
                        if use_fp8:
                            q, s = quant.per_token_cast_to_fp8(self.xs[src][t : t + 1], round_scale, use_ue8m0)
                            self.expect(
                                torch.equal(_bits(values[expert, row]), _bits(q[0])),
                                "torch.equal(_bits(values[expert, row]), _bits(q[0]))",
                            )
                            self.expect(
                                torch.equal(_bits(recv_x[1][expert, row]), _bits(s[0])),
                                "torch.equal(_bits(recv_x[1][expert, row]), _bits(s[0]))",
                            )
                        else:
                            self.expect(
                                torch.equal(_bits(values[expert, row]), _bits(self.xs[src][t])),
                                "torch.equal(_bits(values[expert, row]), _bits(self.xs[src][t]))",
                            )
                self.expect(sorted(got) == sorted(want), "sorted(got) == sorted(want)")
                self.expect(bool((_bits(values[expert, count:]) == 0).all()), "rows past the count must stay zero")

    def check_low_latency_combine(self) -> None:
        for use_fp8, limit in ((False, LL_COMBINE_DIFF_BF16), (True, LL_COMBINE_DIFF_FP8)):
            self._check_low_latency_combine(use_fp8, limit)

    def _check_low_latency_combine(self, use_fp8: bool, limit: float) -> None:
        (recv_x, recv_count, handle, _, _), _ = self._ll(use_fp8=use_fp8)
        if use_fp8:
            flat_q = recv_x[0].reshape(-1, HIDDEN)
            flat_s = recv_x[1].reshape(-1, HIDDEN // 128)
            simulated = quant.per_token_cast_back(flat_q, flat_s).view_as(recv_x[0]).to(torch.bfloat16)
        else:
            simulated = recv_x
        poison = torch.full((self.xs[self.rank].shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16)
        out, _, _ = self.buffer.low_latency_combine(
            simulated, self.idxs[self.rank], self.weights[self.rank], handle, out=poison
        )
        self.expect(out.data_ptr() == poison.data_ptr(), "out.data_ptr() == poison.data_ptr()")
        self.expect(not bool(out.isnan().any()), "not bool(out.isnan().any())")
        idx, w = self.idxs[self.rank], self.weights[self.rank]
        if use_fp8:
            deq = quant.per_token_cast_back(*quant.per_token_cast_to_fp8(self.xs[self.rank])).to(torch.bfloat16)
        else:
            deq = self.xs[self.rank]
        want = ref.low_latency_combine(lambda t, e: deq[t], idx, w)
        if want is None:
            self.expect(out.numel() == 0 or bool((out == 0).all()), "out.numel() == 0 or bool((out == 0).all())")
            return
        diff = ref.calc_diff(out, want)
        self.expect(diff < limit, f"use_fp8={use_fp8}: calc_diff {diff} >= {limit}")

    def check_repeatable(self) -> None:
        def once():
            recv_x, recv_idx, recv_w, _, handle, _ = self.dispatch(self.xs[self.rank])
            combined, combined_w, _ = self.buffer.combine(recv_x, handle, recv_w)
            (ll_x, ll_count, ll_handle, _, _), _ = self._ll(use_fp8=False)
            ll_out, _, _ = self.buffer.low_latency_combine(
                ll_x, self.idxs[self.rank], self.weights[self.rank], ll_handle
            )
            return [recv_x, recv_idx, recv_w, combined, combined_w, ll_x, ll_count, ll_handle[0], ll_out]

        first = once()
        for i in range(REPEATS - 1):
            again = once()
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(first, again, strict=True))
            self.expect(same, f"run {i + 2} differs")

    # ------------------------------------------------------------------ bad input (R = 2 only)
    def check_bad_input(self) -> None:
        b, x, idx, w = self.buffer, self.xs[0], self.idxs[0], self.weights[0]
        args = _layout_args(b, idx, self.experts)

        def raises(error, fn, *words):
            try:
                fn()
            except error as exc:
                self.expect(all(word in str(exc) for word in words), f"{exc!r} lacks {words}")
                return
            self.expect(False, f"{fn} (expecting {words}) did not raise {error.__name__}")

        bad_idx = idx.clone()
        bad_idx[1, 0] = self.experts
        # The device proxy copies tensors in and out; the layout's own tensors must reach the dispatch here.
        raw, device = (b.buffer, b.device) if isinstance(b, DeviceProxy) else (b, torch.device("cpu"))
        try:
            bad_layout = raw.get_dispatch_layout(bad_idx.to(device), self.experts)
        except BoundsError as exc:
            self.expect(str(self.experts) in str(exc), f"{exc!r} lacks {self.experts}")
        else:
            # cuda: the layout does not sync with the host; the out-of-range id travels with the layout into the
            # fresh dispatch's count exchange, where every rank raises before any row moves.
            self.expect(b.strategy_name == "cuda", f"{b.strategy_name}: get_dispatch_layout accepted id {self.experts}")
            raises(
                BoundsError,
                lambda: raw.dispatch(
                    x.to(device),
                    num_tokens_per_rank=bad_layout[0],
                    is_token_in_rank=bad_layout[3],
                    num_tokens_per_rdma_rank=bad_layout[1],
                    num_tokens_per_expert=bad_layout[2],
                ),
                str(self.experts),
            )
        raises(BoundsError, lambda: b.dispatch(x, **args, topk_idx=bad_idx, topk_weights=w), "num_experts")
        raises(ConfigError, lambda: b.dispatch(x, **args, topk_idx=idx.int(), topk_weights=w), "int32")
        raises(ConfigError, lambda: b.dispatch(x, **args, topk_idx=idx, topk_weights=w[:, :2]), "shape")
        raises(ConfigError, lambda: b.dispatch(x, **args, topk_idx=idx, topk_weights=None), "together")
        raises(ConfigError, lambda: b.dispatch(x.int(), **args), "dtype")
        raises(ConfigError, lambda: b.dispatch(x, **args, topk_idx=idx, topk_weights=w.double()), "float32")
        odd = torch.zeros(x.shape[0], 192, dtype=torch.float8_e4m3fn)
        raises(AlignmentError, lambda: b.dispatch((odd, torch.ones(x.shape[0], 1)), **args), "192")
        raises(AlignmentError, lambda: quant.per_token_cast_to_fp8(torch.ones(2, 192)), "192")
        small = Buffer(None, num_nvl_bytes=128, strategy="alltoall", timeout_s=10)
        raises(CapacityError, lambda: small.dispatch(x, **args, topk_idx=idx, topk_weights=w), "128")
        no_ll = Buffer(
            None, num_nvl_bytes=NVL_BYTES, num_rdma_bytes=128, low_latency_mode=True, strategy="alltoall", timeout_s=10
        )
        raises(CapacityError, lambda: no_ll.low_latency_dispatch(x, idx, LL_MAX_TOKENS, self.experts), "num_rdma_bytes")
        stats = torch.full((EXPERTS_PER_RANK,), 7, dtype=torch.int32)
        raises(
            PayloadTooLarge,
            lambda: b.low_latency_dispatch(
                x, idx, x.shape[0] - 1, self.experts, cumulative_local_expert_recv_stats=stats
            ),
            str(x.shape[0] - 1),
        )
        self.expect(bool((stats == 7).all()), "a rejected call must leave the stats intact")
        raises(
            ConfigError,
            lambda: b.low_latency_dispatch(
                x, idx, LL_MAX_TOKENS, self.experts, async_finish=True, return_recv_hook=True
            ),
            "exclusive",
        )
        raises(AlignmentError, lambda: Buffer(None, num_nvl_bytes=100), "128")
        (ll_x, _, ll_handle, _, _), _ = self._ll(use_fp8=False)
        poison = torch.full((x.shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16)
        raises(ConfigError, lambda: b.low_latency_combine(ll_x, idx, w[:, :1], ll_handle, out=poison), "shape")
        self.expect(bool(poison.isnan().all()), "a rejected combine must not write out=")
        # Nothing above reached the wire: a valid dispatch on the same group still pairs up across ranks.
        self.check_dispatch_bf16()


def run_all(rank: int, world: int, strategy: str = "alltoall", device: str = "cpu", checks_class: type = None) -> dict:
    """Run every check (of ``checks_class``, default :class:`Checks`); returns check name -> "ok", the failed
    expectations, or a traceback."""
    import torch.distributed as dist

    checks = (checks_class or Checks)(rank, world, strategy, device)
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=VOTE_S))
    names = [n for n in dir(checks) if n.startswith("check_") and (world == 2 or n != "check_bad_input")]
    results: dict[str, str] = {}
    aborted = None
    # Bad input last: it ends with a dispatch that shows nothing before it reached the wire.
    for name in sorted(names, key=lambda n: (n == "check_bad_input", n)):
        if aborted is not None:
            results[name] = f"not run: {aborted}"
            continue
        checks.failures, checks.num_failures = [], 0
        raised = None
        try:
            getattr(checks, name)()
        except Exception:
            raised = traceback.format_exc()
        if raised is not None:
            results[name] = raised
        elif checks.num_failures:
            results[name] = f"{checks.num_failures} failed expectation(s):\n" + "\n".join(checks.failures)
        else:
            results[name] = "ok"
        votes: list = [None] * world
        dist.all_gather_object(votes, raised is not None, group=side)
        if any(votes):
            ranks = [r for r, v in enumerate(votes) if v]
            aborted = f"{name} raised on rank(s) {ranks}, so peers may still be inside its collectives"
    checks.buffer.destroy()  # local: releases what the strategy holds (the aiv strategy's emulated device)
    return results


def run_all_with_env(rank: int, world: int, env: dict, *args) -> dict:
    """:func:`run_all` with ``env`` set in this rank's environment first (e.g. ``ADP_EMU_CAPABILITY_BITMAP``)."""
    import os

    os.environ.update(env)
    return run_all(rank, world, *args)


class InjectedFailureChecks(Checks):
    """Checks plus one that fails a value expectation after communicating: every other check must still run."""

    def check_aaa_injected_failure(self) -> None:
        recv_x, *_ = self.dispatch(self.xs[self.rank])
        self.expect(recv_x.shape[0] < 0, "injected failure")
        self.expect(True, "a met expectation records nothing")


def make_inputs_one_rank_receives_nothing(world: int, seed: int = 0):
    """Every token of every rank goes to rank 0's experts only, and the last rank has no token: the other ranks
    receive no row at all (dispatch and combine of empty exchanges)."""
    xs, idxs, weights, experts = make_inputs(world, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for idx in idxs:
        if idx.shape[0] == 0:
            continue
        local = torch.stack([torch.randperm(EXPERTS_PER_RANK, generator=g)[:TOPK] for _ in range(idx.shape[0])])
        idx.copy_(torch.where(idx >= 0, local.reshape(idx.shape), idx))
    return xs, idxs, weights, experts


class EmptyRankChecks(Checks):
    """Every check with inputs under which only rank 0 receives: a rank with no token to send or receive."""

    def __init__(self, rank: int, world: int, strategy: str = "alltoall", device: str = "cpu") -> None:
        super().__init__(rank, world, strategy, device)
        self.xs, self.idxs, self.weights, self.experts = make_inputs_one_rank_receives_nothing(world)
        self.expected = ref.dispatch(self.xs, self.idxs, self.weights, self.experts)
        self.mine = self.expected[rank]
