"""``aiv``: normal dispatch/combine with our AscendC kernels on the emulated device (fullmesh or two-hop).

Each rank opens an emulated NPU on one fabric shared by the group (rank 0 creates it, the others attach)
and an emulated HCCL communicator over it (windows, notify area and queue-pair numbers exchanged through
the process group, :func:`ascend_dualpath.backends.emulator.init_comm`). The token rows move through the
emulated RDMA dataplane only:

- ``moe_dispatch`` (``op_kernels/moe_dispatch``): the vector cores pack, per destination rank, the rows
  routed there contiguously into the send window, write them into the peer's receive window and raise this
  op's notify magic there; with the communicator's capability bit 0x04 (AIV dataplane) each core posts the
  WQEs on its own SQs, otherwise the cores fill BatchWrite items that core 0 submits to the AICPU server.
  Then each core waits (bounded) for its sources' notifies and unpacks their rows into the outputs.
- ``moe_combine`` (``op_kernels/moe_combine``): the reverse exchange, then the float32 sum of each token's
  rows over destination ranks 0..R-1, then the biases, rounded to nearest-even (bit-exact with
  :meth:`Strategy.combine_rows`). The weighted (MC2) combine arrives here with the rows already scaled.

The low-latency ops' rows (already grouped by destination by ``Buffer``) go through ``moe_dispatch`` too
(:meth:`AivStrategy.exchange_rows`; the per-expert packing stays on the host). Counts and layouts are
exchanged over the process group (inherited from ``alltoall``). With ``ranks_per_node`` < R, normal ops take
two hops (RDMA to the same-index rank of the target node, then intra-node; :meth:`AivStrategy._routes`).

Receive windows have two halves used by alternate ops: a rank returns from op k only after every peer's notify
of op k arrived, i.e. after every peer finished op k - 1, so op k + 1 never writes a half a peer still reads.
That argument needs every op to link every pair. A two-hop op links only a clique of ranks (hop 1: the same-index
ranks of all nodes; hop 2: the ranks of one node), so each route (fullmesh, hop 1, hop 2) has its own region of
the window, with two halves used by alternate ops *of that route*: within a clique the argument holds again (a
rank returns from the route's op n only after every clique peer finished its op n - 1 of the route), and no other
route writes the region. With one pair of halves shared by all routes, relay A could finish hop 1 of the next
dispatch (which does not link A with its node peer B) and write hop 2 into the half B was still unpacking from
the previous hop 2: the race that corrupted rows at 8 ranks.
The magic of source ``s`` in op ``k`` is ``0x4D << 56 | s << 32 | k``: a wait for op k is satisfied by it or a
later one of the same source (``notify_reached`` in ``moe_exchange.h``), never by an earlier flag.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ascend_dualpath import _env, _ext
from ascend_dualpath.dualpath.traffic import TrafficClass, comm_config_fields
from ascend_dualpath.errors import AdpError, BackendUnavailable, ConfigError, ProtocolError, QueueError, WaitTimeout
from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy
from ascend_dualpath.moe.strategies.base import NormalPlan, PendingRows

# Vector cores per launch (destinations and sources are shared out over them): more cores than ranks
# would idle, and on the CPU emulator every core is a thread.
MAX_BLOCK_DIM = 4
# Largest piece one WQE / BatchWrite item carries (the transfer engine's assumption, no public figure).
MAX_SINGLE_PAYLOAD = 1 << 20
# Link patterns of an op; each has its own receive-window region (two halves), see the module docstring.
ROUTES = ("all", "hop1", "hop2")
# Head of windows_out holding this rank's magic word (the source of the notify writes).
STAGING_BYTES = 64
HALF_ALIGN = 4096
MIN_WINDOW_MB = 1
MAGIC_TAG = 0x4D  # 'M'; below 0x80 so the magic fits the kernel table's int64
NOTIFY_SLOT_BYTES = 32
BATCH_WRITE_ITEM_BYTES = 32
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# Syndrome of a WQE flushed behind an earlier failure (not the cause).
SYNDROME_FLUSHED = 16


def availability(group: Any) -> tuple[bool, str]:
    try:
        C = _ext.load()
    except BackendUnavailable as exc:
        return False, f"aiv strategy needs the compiled emulated device runtime: {exc}"
    if not hasattr(C, "launch_moe_exchange"):
        return False, "aiv strategy needs ascend_dualpath._C with the MoE kernels; rebuild the extension"
    try:
        import torch.distributed as dist

        backend = dist.get_backend(group)
    except Exception as exc:
        return False, f"aiv strategy needs an initialised process group ({exc})"
    if backend != "gloo":
        return False, f"aiv strategy runs on the emulated device with CPU tensors: needs a gloo group, not {backend!r}"
    return True, "AscendC kernels on the emulated device"


def _prefix(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums along the last axis."""
    return np.cumsum(counts, axis=-1) - counts


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


class AivStrategy(AllToAllStrategy):
    """Fullmesh normal dispatch/combine through the ``moe_dispatch`` / ``moe_combine`` kernels.

    Parameters
    ----------
    group : a gloo ProcessGroup
    timeout_s : float
        Bound of every wait (kernel notify waits, SQ space, completions, the launch itself).
    block_dim : int or None
        Vector cores per launch (default ``min(R, 4)``).
    max_payload : int
        Largest piece one WQE or BatchWrite item carries.
    ranks_per_node : int or None
        Ranks per node; fewer than R makes normal ops two-hop (hierarchy). Default R: fullmesh.

    Attributes
    ----------
    last_vtime_ns : float
        Emulator virtual time at which the last launch's sends completed (latest notify CQE, or the AICPU
        server's BatchWrite completion).
    """

    name = "aiv"

    def __init__(
        self,
        group: Any,
        timeout_s: float,
        block_dim: int | None = None,
        max_payload: int = MAX_SINGLE_PAYLOAD,
        ranks_per_node: int | None = None,
    ) -> None:
        super().__init__(group, timeout_s)
        import torch.distributed as dist

        from ascend_dualpath.backends import emulator

        self._C = _ext.load()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.ranks_per_node = ranks_per_node or self.world
        if self.ranks_per_node < 1 or self.world % self.ranks_per_node:
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide the group size {self.world}"
            )
        ranks = np.arange(self.world)
        local, node = ranks % self.ranks_per_node, ranks // self.ranks_per_node
        # pairs each route links: every pair; the same-index ranks of all nodes; the ranks of one node
        self._links = {
            "all": np.ones((self.world, self.world), dtype=bool),
            "hop1": local[:, None] == local,
            "hop2": node[:, None] == node,
        }
        self._route_ops = dict.fromkeys(ROUTES, 0)  # ops run per route: the parity picks the region's half
        self._regions = len(ROUTES) if self.hierarchy else 1
        self.block_dim = block_dim or min(self.world, MAX_BLOCK_DIM)
        self.max_payload = max_payload
        names: list = [None] * self.world
        fabric = emulator.create_fabric(emulator.new_fabric_name("moe")) if self.rank == 0 else None
        dist.all_gather_object(names, fabric.name if fabric else None, group=group)
        self.fabric = fabric or emulator.attach_fabric(names[0], timeout_s)
        # rank 0 must not unlink the fabric's name (close) before every rank attached
        dist.barrier(group=group)
        overrides = {}
        bitmap = _env.emu_capability_bitmap()
        if bitmap is not None:
            overrides["capability_bitmap"] = bitmap
        self.device = emulator.open_device(self.fabric, device_id=self.rank, **overrides)
        if not 1 <= self.block_dim <= self.device.profile.vector_cores:
            raise ConfigError(
                f"block_dim {self.block_dim} is outside [1, {self.device.profile.vector_cores}] vector cores"
            )
        self.comm: Any = None
        self._items: Any = None
        self._epoch = 0
        self._broken: str | None = None
        self.last_vtime_ns = 0.0

    # ------------------------------------------------------------------ resources
    @property
    def dataplane(self) -> str:
        """``"aiv"`` (vector cores post WQEs) or ``"aicpu"`` (BatchWrite through the AICPU server)."""
        return "aiv" if self.device.profile.capability_bitmap & 0x04 else "aicpu"

    def _ensure_windows(self, recv_bytes: int, send_bytes: int) -> None:
        """A communicator whose windows hold two receive halves of ``recv_bytes`` per route region and ``send_bytes``
        to send.

        Every rank passes the same sizes (maxima over the whole count matrix), so every rank rebuilds at the
        same op, and the rebuild's RankInfo exchange happens only once every rank finished the previous op.
        """
        half = -(-max(recv_bytes, 1) // HALF_ALIGN) * HALF_ALIGN
        needed = max(2 * self._regions * half, STAGING_BYTES + send_bytes)
        if self.comm is not None and self.comm.windows_in.size >= needed:
            return
        from ascend_dualpath.backends import emulator

        mb = max(MIN_WINDOW_MB, -(-needed // (1 << 20)))
        old = self.comm
        # the EP all-to-all is model traffic: the high class, served first by the NIC while KV shares it
        config = emulator.comm_config(hcclBufferSize=mb, **comm_config_fields(TrafficClass.MODEL))
        self.comm = emulator.init_comm(self.device, self.group, config)
        if self._items is not None:
            self.comm.register_local(self._items)
        self._peer_in = [self.comm.peer_info(p).windows_in for p in range(self.world)]
        self._peer_notify = [self.comm.peer_info(p).notify for p in range(self.world)]
        if old is not None:
            old.close()

    def _item_array(self, items: int) -> int:
        """Address of a registered BatchWrite item array of at least ``items`` entries."""
        if self._items is None or self._items.size < items * BATCH_WRITE_ITEM_BYTES:
            if self._items is not None:
                self._items.close()
            size = max(4096, 1 << (items * BATCH_WRITE_ITEM_BYTES - 1).bit_length())
            self._items = self.device.alloc_region(size, self._C.MemKind.DEVICE_GM, 1 | 4)
            self.comm.register_local(self._items)
        return self._items.addr

    def close(self) -> None:
        """Release the communicator, the device (its NIC, queues and regions) and this rank's fabric handle."""
        for resource in (self.comm, self._items, self.device, self.fabric):
            if resource is not None:
                resource.close()
        self.comm = self._items = None

    @staticmethod
    def magic(source: int, epoch: int) -> int:
        """The notify value source rank ``source`` raises for op ``epoch``."""
        return (MAGIC_TAG << 56) | (source << 32) | (epoch & 0xFFFFFFFF)

    # ------------------------------------------------------------------ ops
    @property
    def hierarchy(self) -> bool:
        """Whether normal ops take two hops (RDMA to the same-index rank of the target node, then intra-node)."""
        return self.ranks_per_node < self.world

    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        parts = [p.contiguous() for p in parts]
        counts = plan.count_matrix.numpy()
        received = int(counts[:, self.rank].sum())
        if self.hierarchy:
            return self._dispatch_hierarchy(plan, parts, received, what)
        outs = [torch.empty((received, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
        self._exchange("moe_dispatch", counts, parts, plan.send_order.to(torch.int32), outs, None, what)
        return outs

    def _receive_half(self, route: str) -> int:
        """Offset in windows_in of the half that this op of ``route`` receives into (advances the route's count)."""
        self._route_ops[route] += 1
        region = ROUTES.index(route) if self._regions > 1 else 0
        half = self.comm.windows_in.size // self._regions // 2 // HALF_ALIGN * HALF_ALIGN
        return (2 * region + self._route_ops[route] % 2) * half

    def _routes(self, plan: NormalPlan) -> dict:
        """The two-hop routes of ``plan`` (kept in it for cached dispatch and combine).

        Hop 1 (RDMA): source s sends each token once per target node n, to relay ``n * P + s % P``. Hop 2
        (intra-node): relay r forwards each row to the ranks of its node the token goes to. Row counts, for every
        pair of ranks (every rank computes the same matrices): ``hop1[s, r]`` = tokens of s for node(r) when
        s % P == r % P; ``hop2[r, d]`` = Σ over the sources s relayed by r of ``C[s, d]`` when r, d share a node.
        """
        private = plan.private if isinstance(plan.private, dict) else {}
        if "aiv_routes" in private:
            return private["aiv_routes"]
        ranks_per_node, me = self.ranks_per_node, self.rank
        nodes = self.world // ranks_per_node
        counts = plan.count_matrix.numpy()
        in_rank = plan.is_token_in_rank
        to_node = in_rank.view(in_rank.shape[0], nodes, ranks_per_node).any(dim=2)
        node_counts = self.exchange_counts(to_node.sum(dim=0), "hierarchical dispatch node counts").numpy()
        ranks = np.arange(self.world)
        node, same_local, same_node = ranks // ranks_per_node, self._links["hop1"], self._links["hop2"]
        hop1 = np.where(same_local, node_counts[:, node], 0)
        hop2 = np.where(same_node, same_local.astype(np.int64) @ counts, 0)
        send1 = torch.cat([to_node[:, n].nonzero()[:, 0] for n in range(nodes)]).to(torch.int32)
        # combine sends every (token, destination) row back over hop 1: back1[r, s] = Σ_{d in node(r)} C[s, d]
        back1 = np.where(same_local, (counts @ same_node.astype(np.int64)).T, 0)
        routes = {
            "hop1": hop1,
            "hop2": hop2,
            "back1": back1,
            "send1": send1,
            "src1": np.repeat(ranks, hop1[:, me]),
            "mine": ranks[node == node[me]],
        }
        # where hop-2 rows land in the receive order (source rank, ascending token): relays in rank order, each
        # relaying its sources in rank order, each source's rows in token order
        recv_begin = _prefix(counts[:, me])
        final = [recv_begin[s] + np.arange(counts[s, me]) for r in routes["mine"] for s in ranks[same_local[r]]]
        routes["final"] = torch.from_numpy(np.concatenate(final).astype(np.int64))
        private["aiv_routes"] = routes
        if isinstance(plan.private, dict):
            plan.private = private
        return routes

    def _dispatch_hierarchy(
        self, plan: NormalPlan, parts: list[torch.Tensor], received: int, what: str
    ) -> list[torch.Tensor]:
        routes, me = self._routes(plan), self.rank
        # hop 1 carries each token's destination mask, so that the relay knows where to forward it
        hop1_parts = parts + [plan.is_token_in_rank.to(torch.uint8).contiguous()]
        relayed = int(routes["hop1"][:, me].sum())
        hop1_out = [torch.empty((relayed, *p.shape[1:]), dtype=p.dtype) for p in hop1_parts]
        self._exchange(
            "moe_dispatch", routes["hop1"], hop1_parts, routes["send1"], hop1_out, None, f"{what} (hop 1)", "hop1"
        )
        mask = hop1_out.pop().bool()
        if "send2" not in routes:
            routes["send2"] = torch.cat([mask[:, d].nonzero()[:, 0] for d in routes["mine"]]).to(torch.int32)
        hop2_out = [torch.empty((received, *p.shape[1:]), dtype=p.dtype) for p in parts]
        self._exchange(
            "moe_dispatch", routes["hop2"], hop1_out, routes["send2"], hop2_out, None, f"{what} (hop 2)", "hop2"
        )
        outs = [torch.empty_like(p) for p in hop2_out]
        for out, rows in zip(outs, hop2_out, strict=True):  # as bytes: index_copy_ has no FP8 kernel
            width = math.prod(out.shape[1:])  # explicit: reshape(0, -1) is ambiguous for a rank receiving nothing
            out.reshape(out.shape[0], width).view(torch.uint8).index_copy_(
                0, routes["final"], rows.reshape(rows.shape[0], width).view(torch.uint8)
            )
        return outs

    def _combine_hierarchy(self, plan: NormalPlan, parts: list[torch.Tensor], reduce: dict) -> None:
        """Hop 2 in reverse (rows back to their relays), then hop 1 in reverse with the reduce of moe_combine.

        The relays only forward: every (token, destination) row reaches its source, which sums them in
        destination-rank order like the fullmesh combine (partial sums at the relays would change the order of the
        float32 additions).
        """
        routes, me = self._routes(plan), self.rank
        back2 = int(routes["hop2"][me].sum())
        hop2_out = [torch.empty((back2, *p.shape[1:]), dtype=p.dtype) for p in parts]
        self._exchange(
            "moe_dispatch",
            routes["hop2"].T.copy(),
            parts,
            routes["final"].to(torch.int32),
            hop2_out,
            None,
            "combine rows (hop 2)",
            "hop2",
        )
        # relay's rows come back per destination (rank order), each in its forward order; return them per source
        source_of_row = routes["src1"][routes["send2"].numpy()]
        order = torch.from_numpy(np.argsort(source_of_row, kind="stable").astype(np.int32))
        self._exchange("moe_combine", routes["back1"], hop2_out, order, [], reduce, "combine rows (hop 1)", "hop1")

    def exchange_rows(
        self, parts: list[torch.Tensor], send_counts: list[int], recv_counts: list[int], what: str
    ) -> PendingRows:
        """The low-latency ops' row exchange through ``moe_dispatch`` (rows already grouped by destination).

        The kernel needs every rank's counts (where its block lands at each peer, the window size), so the
        send counts are all-gathered over the process group first; the rows move when this is called.
        """
        sends = self.exchange_counts(torch.tensor(send_counts, dtype=torch.int64), f"{what} (counts)").numpy()
        if sends[:, self.rank].tolist() != list(recv_counts):
            raise ProtocolError(
                f"{what}: this rank expects {list(recv_counts)} rows from ranks 0..{self.world - 1}, "
                f"but they send {sends[:, self.rank].tolist()}"
            )
        parts = [p.contiguous() for p in parts]
        outs = [torch.empty((sum(recv_counts), *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
        send_index = torch.arange(sum(send_counts), dtype=torch.int32)
        self._exchange("moe_dispatch", sends, parts, send_index, outs, None, what)
        return PendingRows(lambda timeout_s: outs, self.timeout_s)  # the rows moved above

    def combine_rows(
        self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None, biases: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x.dtype not in DTYPE_CODES:
            raise ConfigError(f"aiv combine reduces bf16, fp16 or fp32 rows, got {x.dtype}")
        x = x.contiguous()
        parts = [x] if weights is None else [x, weights.contiguous()]
        counts = plan.count_matrix.numpy()
        tokens, hidden = plan.is_token_in_rank.shape[0], x.shape[1]
        # Row of (token, destination d) in this rank's receive window: d's rows come back at the prefix of
        # what this rank sent to ranks before d, in ascending token order (d's receive order).
        in_rank = plan.is_token_in_rank
        base = torch.from_numpy(_prefix(counts[self.rank]))
        slots = torch.where(in_rank, in_rank.long().cumsum(dim=0) - 1 + base, torch.full_like(base, -1))
        slots = slots.to(torch.int32).contiguous()
        out_x = torch.empty(tokens, hidden, dtype=x.dtype)
        out_w = None if weights is None else torch.empty(tokens, weights.shape[1], dtype=torch.float32)
        bias = [b.contiguous() if b is not None else None for b in biases] + [None, None]
        reduce = dict(
            tokens=tokens,
            hidden=hidden,
            topk=0 if weights is None else weights.shape[1],
            dtype=DTYPE_CODES[x.dtype],
            slots=slots.data_ptr(),
            out_x=out_x.data_ptr(),
            out_w=0 if out_w is None else out_w.data_ptr(),
            bias0=bias[0].data_ptr() if bias[0] is not None else 0,
            bias1=bias[1].data_ptr() if bias[1] is not None else 0,
        )
        if self.hierarchy:
            self._combine_hierarchy(plan, parts, reduce)
        else:
            send_index = torch.arange(x.shape[0], dtype=torch.int32)
            self._exchange("moe_combine", counts.T.copy(), parts, send_index, [], reduce, "combine rows")
        return out_x, out_w

    def _exchange(
        self,
        kernel: str,
        sends: np.ndarray,
        in_parts: list[torch.Tensor],
        send_index: torch.Tensor,
        out_parts: list[torch.Tensor],
        reduce: dict | None,
        what: str,
        route: str = "all",
    ) -> None:
        """Run ``kernel``, which moves ``sends[i, j]`` rows from rank i to rank j through the emulated NICs.

        ``route`` (one of :data:`ROUTES`) names the pairs that exchange in this op (data and notify): every pair,
        the same-index ranks of all nodes (hop 1) or the ranks of one node (hop 2); the rows land in that route's
        region of the receive window. The kernel reads and writes the tensors by address: the caller keeps them
        alive until this returns.
        """
        if self._broken:
            raise QueueError(f"the aiv strategy is unusable after an earlier failure: {self._broken}")
        row = sum(_row_bytes(p) for p in in_parts)
        self._ensure_windows(int(sends.sum(axis=0).max()) * row, int(sends.sum(axis=1).max()) * row)
        self._epoch += 1
        comm, epoch = self.comm, self._epoch
        half = self._receive_half(route)
        linked = self._linked_peers(sends, route, what)
        table, pieces = self._peer_table(sends, linked, row, half, epoch)
        aicpu = not comm.aiv_dataplane
        params = dict(
            row_bytes=row,
            max_payload=self.max_payload,
            total_items=int(pieces.sum()) if aicpu else 0,
            send_window=comm.windows_out.addr + STAGING_BYTES,
            recv_window=comm.windows_in.addr + half,
            magic_staging=comm.windows_out.addr,
            magic=self.magic(self.rank, epoch),
            items=self._item_array(int(pieces.sum())) if aicpu and pieces.sum() else 0,
            start_vtime_ns=self.device.nic.virtual_time_ns,
            submit_ns=self.device.nic.cost.aiv_submit_ns,
        )
        run = self._C.launch_moe_exchange(
            kernel,
            comm,
            params,
            table,
            [(p.data_ptr(), _row_bytes(p)) for p in in_parts],
            [(p.data_ptr(), _row_bytes(p)) for p in out_parts],
            send_index.numpy(),
            reduce,
            self.block_dim,
            self.device.profile.ub_bytes,
            self.timeout_s,
        )
        self._finish_launch(run, kernel, what, int(linked.sum()), aicpu, epoch)

    def _linked_peers(self, sends: np.ndarray, route: str, what: str) -> np.ndarray:
        """bool [R]: the peers ``route`` links this rank with (itself excluded); ProtocolError when ``sends``
        routes rows between this rank and a peer the route does not link."""
        rank = self.rank
        linked = self._links[route][rank].copy()
        linked[rank] = False
        unlinked = ~linked
        unlinked[rank] = False
        if sends[rank][unlinked].any() or sends[unlinked, rank].any():
            raise ProtocolError(
                f"{what}: rows routed between rank {rank} and ranks "
                f"{np.flatnonzero(unlinked).tolist()}, which this op does not link"
            )
        return linked

    def _peer_table(
        self, sends: np.ndarray, linked: np.ndarray, row: int, half: int, epoch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's int64 [R, 10] peer table (remote data address, remote notify address, their rkeys, send
        begin and count, receive begin and count, first BatchWrite item, the peer's magic) and the pieces
        (WQEs / items) per peer."""
        rank = self.rank
        mine = sends[rank]
        send_begin, recv_begin = _prefix(mine), _prefix(sends[:, rank])
        # where this rank's block goes at peer j: after the blocks of ranks 0..rank-1 to j
        remote_offset = _prefix(sends.T)[:, rank]
        pieces = np.where(linked, -(-(mine * row) // self.max_payload) + 1, 0)
        item_begin = _prefix(pieces)
        table = np.zeros((self.world, 10), dtype=np.int64)
        for peer in range(self.world):
            table[peer] = [
                self._peer_in[peer].addr + half + int(remote_offset[peer]) * row,
                self._peer_notify[peer].addr + rank * NOTIFY_SLOT_BYTES,
                self._peer_in[peer].rkey,
                self._peer_notify[peer].rkey,
                send_begin[peer],
                mine[peer],
                recv_begin[peer],
                sends[peer, rank],
                item_begin[peer],
                self.magic(peer, epoch),
            ]
            if not linked[peer] and peer != rank:
                table[peer, 1] = table[peer, 9] = 0  # no notify either way
        return table, pieces

    def _finish_launch(self, run: Any, kernel: str, what: str, num_linked: int, aicpu: bool, epoch: int) -> None:
        """Wait (bounded) for a launch; raise what its cores reported (full SQs, silent peers, failed WQEs)."""
        try:
            status = run.wait(2 * self.timeout_s + 5)
        except WaitTimeout:
            self._broken = f"{kernel} did not finish"
            raise
        stuck = [s["detail"] for s in status if s["code"] == self._C.CORE_SQ_TIMEOUT]
        if stuck:
            self._broken = f"{kernel}: SQs towards ranks {stuck} stayed full"
            raise QueueError(
                f"{what} ({self.name} strategy): the SQs towards ranks {stuck} stayed full for {self.timeout_s:g} s"
            )
        if not aicpu:
            self.last_vtime_ns = self._collect(num_linked, what)
        else:
            self.last_vtime_ns = run.hccl_done_vtime_ns
        silent = sorted(s["detail"] for s in status if s["code"] == self._C.CORE_NOTIFY_TIMEOUT)
        if silent:
            raise WaitTimeout(
                f"waited {self.timeout_s:g} s for {what} ({self.name} strategy): no notify of op "
                f"{epoch} from rank(s) {silent}"
            )

    def _collect(self, expected: int, what: str) -> float:
        """Exactly ``expected`` completions (one signaled notify WQE per peer); raises the first real error."""
        from ascend_dualpath.backends.emulator import completion_error

        cq = self.comm.aiv_qp(0).send_cq
        completions: list = []
        while len(completions) < expected:
            got = cq.poll(expected - len(completions), self.timeout_s)
            if not got:
                self._broken = f"{what} lost completions"
                raise WaitTimeout(
                    f"waited {self.timeout_s:g} s for the completions of {what} ({self.name} "
                    f"strategy): {len(completions)} of {expected} notify WQEs completed"
                )
            completions += got
        errors = [c for c in completions if c.status != 0]
        if errors:
            # ERROR -> ready-to-send once the NIC flushed every posted WQE; then the CQ holds every completion
            # of this op (the failed WQE, possibly unsignaled, and the flushed ones behind it): drain them all.
            for peer in range(self.world):
                self.comm.aiv_qp(peer).reset(self.timeout_s)
            errors += [c for c in cq.poll(cq.depth, 0) if c.status != 0]
            error: AdpError = completion_error(next((c for c in errors if c.syndrome != SYNDROME_FLUSHED), errors[0]))
            raise error
        return max((c.vtime_ns for c in completions), default=0.0)


def create(group: Any, timeout_s: float, **options: Any) -> AivStrategy:
    return AivStrategy(group, timeout_s, **options)
