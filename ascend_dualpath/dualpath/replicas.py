"""Rows that several tensor-parallel ranks of one instance hold, moved once: one rank reads and transfers them, its
replicas take them from it inside the instance.

Every rank of an instance holds MLA's whole latent, and vLLM replicates a GQA head over ``size / kv_heads`` ranks
where the model has fewer KV heads than ranks (:attr:`~ascend_dualpath.kv.layout.KVShard.replicas`). Per request, one
replica is its *lead* (:meth:`~ascend_dualpath.kv.layout.KVShard.lead`: spread over the replicas by the transfer id; a
PE's lead is the one paired with the DE's lead): only the lead runs the request through the DualPath halves (its
storage reads on either path, its transfer between the instances), so a replicated unit is read from storage and
sent over the network once per instance, not once per rank. The other replicas get the lead's rows from it over the
instance's process group (vLLM's tensor-parallel group, whose ranks share a host):

- **PE**: after each layer's load, the lead sends the step's hit rows ``[computed, hit_tokens)`` of that layer to its
  replicas, which write them into their paged caches before the layer's attention; only the lead sends the computed
  rows to the DE. A replica's read ahead is ready at once (vLLM takes a request once every rank reported it ready,
  with the fewest tokens any reported: the lead's report decides).
- **DE**: only the lead takes the receive; while any receive of the instance waits, each ``get_finished`` gathers
  which of them the ranks' leads ended (:class:`RecvsEnded`); once a replica's lead ended one, the lead sends its
  rows ``[computed, end)`` of every layer to its replicas and they all report it (or all report it failed).

Every rank of the instance decides from the same step metadata and the same gathered answers, so the ranks' sends,
receives and gathers pair up in one order; each waits at most ``timeout_s`` and names what it waited for.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec
from ascend_dualpath.errors import ConfigError, ProtocolError, WaitTimeout
from ascend_dualpath.kv.layout import KVShard

TAG = 0x44504C  # one tag for every message of this module: the ranks post them in one order
# a replica waits for its lead's rows up to this many timeout_s: the lead's layer may wait timeout_s for the DE's
# push, then take the DE's half over with reads of its own (timeout_s more) before it sends
LEAD_WAITS = 3


class RecvsEnded(msgspec.Struct, frozen=True):
    """What a DE rank's lead ended since the last gather: the request ids received, and those of them that failed."""

    ended: list[str]
    failed: list[str]


class RankGroup:
    """The tensor-parallel ranks of one instance: a ``torch.distributed`` process group of the gloo backend
    (vLLM's tensor-parallel group's ``cpu_group``; the tests make one per instance). Rows cross it as ``uint8``
    CPU tensors; every wait is bounded by ``timeout_s``.
    """

    def __init__(self, group: Any, timeout_s: float) -> None:
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ConfigError(f"the rank group's timeout must be a positive finite number of seconds, got {timeout_s}")
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.size = group.rank(), group.size()

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], what: str) -> None:
        """Send each ``(tensor, rank)`` of ``sends`` and receive into each of ``recvs`` (contiguous CPU tensors)."""
        works = [self.group.send([tensor], rank, TAG) for tensor, rank in sends]
        works += [self.group.recv([tensor], rank, TAG) for tensor, rank in recvs]
        self._wait(works, what)

    def gather(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload``, by rank."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait([self.group.allgather([sizes], [torch.tensor([len(payload)])])], what)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._wait([self.group.allgather([out], [mine])], what)
        return [bytes(t[: int(n)].numpy()) for t, n in zip(out, sizes, strict=True)]

    def _wait(self, works: list, what: str) -> None:
        limit = datetime.timedelta(seconds=self.timeout_s)
        for work in works:
            try:
                work.wait(limit)
            except RuntimeError as error:
                raise WaitTimeout(
                    f"tensor-parallel rank {self.rank} of {self.size}: {what} did not complete within "
                    f"timeout_s={self.timeout_s} s ({error})"
                ) from None


@dataclasses.dataclass
class _Relay:
    """One request whose rows this rank's replica group shares: ``lead`` moves them, the group takes them."""

    spec: Any
    lead: int


class Replicas:
    """This rank's share of the copies between the replicas of its units (module docstring).

    Parameters
    ----------
    shard : KVShard
        The rank's share of the model's rows.
    group : RankGroup, optional
        The instance's ranks; required where the shard has replicas (a tensor-parallel size above 1 with MLA, or with
        fewer KV heads than ranks), unused otherwise.
    """

    def __init__(self, shard: KVShard, group: RankGroup | None) -> None:
        self.shard, self.group = shard, group
        self.active = len(shard.replicas) > 1
        if self.active and (group is None or (group.rank, group.size) != (shard.rank, shard.size)):
            where = "none" if group is None else f"rank {group.rank} of {group.size}"
            raise ConfigError(
                f"tensor-parallel rank {shard.rank} of {shard.size} shares its KV with ranks {list(shard.replicas)} "
                f"and needs its instance's process group as that rank, got {where}"
            )
        self._loads: list[_Relay] = []  # this step's loads with hit rows, in the step's order
        self._ready: dict[str, int] = {}  # a replica's reads ahead: ready at once
        self._recvs: dict[str, RecvSpec] = {}  # receives not yet ended on every replica group (the same on every rank)
        self._ended: dict[str, set[int]] = {}  # req_id -> the groups (by lead) whose lead ended it

    # -- PE --------------------------------------------------------------------------------------------------------
    def mine(self, specs: list, peer_size: Callable[[str], int]) -> list:
        """Those of ``specs`` (LoadSpecs or SaveSpecs) whose rows this rank moves (all without replicas);
        ``peer_size``: a DE's tensor-parallel size by its address."""
        if not self.active:
            return specs
        return [spec for spec in specs if self._lead(spec, peer_size) == self.shard.rank]

    def _lead(self, spec: Any, peer_size: Callable[[str], int]) -> int:
        if spec.xfer is None:
            return self.shard.lead(spec.req_id)
        return self.shard.lead(spec.xfer.xfer_id, peer_size(spec.xfer.peer) or None)

    def read_ahead(self, specs: list[LoadSpec], peer_size: Callable[[str], int]) -> list[LoadSpec]:
        """The reads ahead this rank runs; the others are ready at once with every hit token (:meth:`ready`)."""
        if not self.active:
            return specs
        leads = [self._lead(spec, peer_size) for spec in specs]
        self._ready |= {s.req_id: s.hit_tokens for s, lead in zip(specs, leads, strict=True) if lead != self.shard.rank}
        return [spec for spec, lead in zip(specs, leads, strict=True) if lead == self.shard.rank]

    def ready(self) -> dict[str, int]:
        """The reads ahead :meth:`read_ahead` left to other ranks, since the last call."""
        ready, self._ready = self._ready, {}
        return ready

    def start(self, loads: list[LoadSpec], peer_size: Callable[[str], int]) -> list[LoadSpec]:
        """A step's loads: those this rank runs (the others' hit rows come from their leads, :meth:`copy_layer`)."""
        if not self.active:
            return loads
        leads = [self._lead(spec, peer_size) for spec in loads]
        self._loads = [_Relay(s, lead) for s, lead in zip(loads, leads, strict=True) if s.hit_tokens > s.computed]
        return [spec for spec, lead in zip(loads, leads, strict=True) if lead == self.shard.rank]

    def copy_layer(self, layer: int, cache: torch.Tensor, adapter: Any) -> None:
        """Layer ``layer``'s hit rows of this step's loads from each load's lead to its replicas (after the lead's
        :meth:`~ascend_dualpath.dualpath.prefill_side.PrefillSide.wait_for_layer_load`; a lead whose load failed
        sends what its cache holds, and reports the blocks to recompute for every rank)."""
        sends, recvs, writes = [], [], []
        for relay in self._loads:
            spec = relay.spec
            if relay.lead == self.shard.rank:
                rows = _cpu(adapter.read_tokens(cache, spec.block_ids, spec.computed, spec.hit_tokens))
                sends += [(rows, rank) for rank in self.shard.replicas if rank != self.shard.rank]
            else:
                rows = torch.empty(spec.hit_tokens - spec.computed, self.shard.local.token_bytes, dtype=torch.uint8)
                recvs.append((rows, relay.lead))
                writes.append((spec, rows))
        if not sends and not recvs:
            return
        self.group.exchange(sends, recvs, f"layer {layer}'s hit rows of {[r.spec.req_id for r in self._loads]}")
        for spec, rows in writes:
            adapter.write_tokens(cache, spec.block_ids, spec.computed, rows.to(cache.device))

    # -- DE --------------------------------------------------------------------------------------------------------
    def add_recv(self, spec: RecvSpec) -> bool:
        """Whether this rank takes ``spec``'s receive itself (its lead); a reported one is relayed (all ranks)."""
        if not self.active:
            return True
        if spec.report:
            self._recvs[spec.req_id] = spec
        return self.shard.lead(spec.xfer.xfer_id) == self.shard.rank

    def end_recvs(self, recving: set[str], failed: set[str], caches: list[torch.Tensor], adapter: Any) -> None:
        """What vLLM is told this step (``recving`` / ``failed``, updated in place): the receives this rank's group
        lead ended, once the lead's rows are in every replica's cache. Gathers every rank's ends while any receive of
        the instance waits (every rank's decision: the receives are the same everywhere)."""
        if not self.active or not self._recvs:
            return
        mine = RecvsEnded(sorted(recving & self._recvs.keys()), sorted(failed & self._recvs.keys()))
        recving.difference_update(self._recvs)  # in place: these are the sets vLLM is handed
        failed.difference_update(self._recvs)
        gathered = self.group.gather(msgspec.msgpack.encode(mine), f"the ends of receives {sorted(self._recvs)}")
        done = self._take_ends([msgspec.msgpack.decode(answer, type=RecvsEnded) for answer in gathered])
        self._copy_recvs([(spec, lead) for spec, lead, ok in done if ok and spec.end > spec.computed], caches, adapter)
        for spec, _, ok in done:
            recving.add(spec.req_id)
            if not ok:
                failed.add(spec.req_id)

    def _copy_recvs(self, ended: list[tuple[RecvSpec, int]], caches: list[torch.Tensor], adapter: Any) -> None:
        """The rows ``[computed, end)`` of every layer of each ``(spec, lead)`` from the lead to its replicas
        (``uint8 [L, end - computed, C]`` per request and replica)."""
        sends, recvs = [], []
        for spec, lead in ended:
            if lead == self.shard.rank:
                rows = [adapter.read_tokens(cache, spec.block_ids, spec.computed, spec.end) for cache in caches]
                stacked = _cpu(torch.stack(rows))
                sends += [(stacked, rank) for rank in self.shard.replicas if rank != lead]
            else:
                shape = (len(caches), spec.end - spec.computed, self.shard.local.token_bytes)
                recvs.append((torch.empty(shape, dtype=torch.uint8), lead, spec))
        what = f"the rows of receives {[spec.req_id for spec, _ in ended]}"
        self.group.exchange(sends, [(rows, lead) for rows, lead, _ in recvs], what)
        for rows, _, spec in recvs:
            for layer, cache in enumerate(caches):
                adapter.write_tokens(cache, spec.block_ids, spec.computed, rows[layer].to(cache.device))

    def _take_ends(self, answers: list[RecvsEnded]) -> list[tuple[RecvSpec, int, bool]]:
        """``(spec, lead, ok)`` of each receive the lead of this rank's group ended (in the gathered ``answers``, by
        rank); a receive every group's lead ended is relayed no more."""
        done = []
        for rank, answer in enumerate(answers):
            for req_id in answer.ended:
                spec = self._recvs.get(req_id)
                if spec is None or self.shard.full.shard(self.shard.size, rank).lead(spec.xfer.xfer_id) != rank:
                    raise ProtocolError(f"tensor-parallel rank {rank} ended receive {req_id}, which it does not lead")
                self._ended.setdefault(req_id, set()).add(rank)
                if rank in self.shard.replicas:
                    done.append((spec, rank, req_id not in answer.failed))
        groups = self.shard.size // len(self.shard.replicas)
        for req_id in [req_id for req_id, leads in self._ended.items() if len(leads) == groups]:
            del self._recvs[req_id], self._ended[req_id]
        return done


def _cpu(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous() if rows.device.type == "cpu" else rows.cpu()
