"""The two DualPath read paths (seed 000, "Dual-Path Loading"), decode-engine side, and the load plan.

A request's cached prefix is ``n`` Full Blocks ``[L, T, C]`` (``T_hit = n*T`` tokens); its ``T_miss`` new
tokens are prefilled on the PE layer by layer. Both paths end with the complete prompt KV in DE HBM as
``[L, T_cap, C]`` (layer-major, tokens in order, heads inside ``C`` untouched), rows ``[0, T_all)`` filled.

PE read path (``ReadPath.PE``)
    PE SNIC reads the hit blocks into a ``pe_buffer`` lease; per layer the PE copies the hit Layer Block rows
    into a PE HBM slot, computes the miss rows next to them and writes the complete layer ``[T_all, C]`` into
    the DE's ``de_buffer`` lease, laid out ``[L, T_all, C]``. The DE then does one H2D of the lease.
DE read path (``ReadPath.DE``)
    DE SNIC reads the hit blocks into the ``de_buffer`` lease, laid out ``[n, L, T, C]`` (hit) followed by
    ``[L, T_miss, C]`` (miss); per layer the DE ships the ``n`` hit Layer Blocks into a PE HBM slot, the PE
    returns only the miss rows into the miss area, and the H2D merges hit and miss rows of every layer.

Both layouts take ``L * T_all * C`` bytes, so a request's ``de_buffer`` lease is admitted once and reused if
the request falls back to the other path. The PE keeps two HBM slots (layer ``l`` uses slot ``l % 2``): the
DE pushes layer ``l + 2`` only after the PE has returned layer ``l``, so the push of the next layer overlaps
the compute of the current one. The PE side is :class:`~ascend_dualpath.dualpath.connector.PrefillConnector`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.transfer_leg import ABORT_SLOT, LayerTransferLeg, wait_notify
from ascend_dualpath.kv.layout import KVLayout

PE_RANK, DE_RANK = 0, 1


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Everything the PE needs to prefill one request attempt; sent DE -> PE on the control channel.

    Magics are drawn by the DE's communicator for this attempt only, so no flag of an earlier attempt can
    satisfy a wait of this one.
    """

    request_id: int
    attempt: int
    path: ReadPath
    new_tokens: tuple[int, ...]
    hit_block_ids: tuple[bytes, ...]
    de_lease_addr: int  # registration address of the DE buffer lease
    hit_magics: tuple[int, ...]  # DE -> PE: hit layer l is in the PE slot (DE path)
    save_magics: tuple[int, ...]  # PE -> DE: layer l is in the DE buffer
    abort_to_pe: int
    abort_to_de: int

    @property
    def key(self) -> tuple[int, int]:
        return self.request_id, self.attempt

    def lease(self, layout: KVLayout) -> LeaseLayout:
        """The DE lease of this attempt: complete layers on the PE path, hit blocks then new rows on the DE path."""
        hit = len(self.hit_block_ids) * layout.block_tokens
        return LeaseLayout(layout, hit + len(self.new_tokens), 0 if self.path is ReadPath.PE else hit)


def make_plan(
    comm: Any,
    request_id: int,
    attempt: int,
    path: ReadPath,
    new_tokens: list[int],
    hit_block_ids: list[bytes],
    de_lease_addr: int,
    num_layers: int,
) -> LoadPlan:
    """A plan with fresh magics from ``comm`` (the DE's communicator)."""
    magics = [comm.next_magic() for _ in range(2 * num_layers + 2)]
    return LoadPlan(
        request_id,
        attempt,
        path,
        tuple(new_tokens),
        tuple(hit_block_ids),
        de_lease_addr,
        tuple(magics[:num_layers]),
        tuple(magics[num_layers : 2 * num_layers]),
        magics[-2],
        magics[-1],
    )


@dataclasses.dataclass
class PathTimes:
    """Where the DE-side time of one attempt went (wall clock) and the transfers' virtual clock."""

    layers_s: float = 0.0
    h2d_s: float = 0.0
    vtime_ns: float = 0.0


def de_side_de_path(
    plan: LoadPlan,
    layout: KVLayout,
    comm: Any,
    leg: LayerTransferLeg,
    pe_slot_addrs: list[int],
    timeout_s: float,
    times: PathTimes,
) -> None:
    """DE side of the DE read path, after its SNIC read the hit blocks into the lease at ``plan.de_lease_addr``.

    Pushes hit layer ``l`` into PE slot ``l % 2`` (notify ``hit_magics[l]``), waits for the PE to return miss
    layer ``l`` (notify ``save_magics[l]``), then pushes layer ``l + 2`` into the freed slot. Raises
    :class:`TransferFailed` or :class:`PeerAborted`; the caller aborts the PE and wipes the lease.
    """
    start = time.monotonic()
    lease, L = plan.lease(layout), layout.num_layers

    def push(layer: int):
        return leg.submit(
            layer,
            lease.hit_layer_segments(plan.de_lease_addr, layer),
            PE_RANK,
            pe_slot_addrs[layer % 2],
            layer,
            plan.hit_magics[layer],
        )

    pushes = {layer: push(layer) for layer in range(min(2, L))}
    for layer in range(L):
        times.vtime_ns = max(times.vtime_ns, leg.wait(pushes.pop(layer), timeout_s))
        ahead = pushes.get(layer + 1)
        wait_notify(
            comm,
            layer,
            plan.save_magics[layer],
            f"miss KV of layer {layer} of request {plan.request_id} from the PE (DE read path)",
            abort_magic=plan.abort_to_de,
            timeout_s=timeout_s,
            # the leg has no thread: polling ends the push of layer l + 1, so its notify reaches the PE meanwhile
            check=None if ahead is None else functools.partial(leg.raise_if_failed, ahead),
        )
        if layer + 2 < L:
            pushes[layer + 2] = push(layer + 2)
    times.layers_s += time.monotonic() - start


def de_side_pe_path(plan: LoadPlan, layout: KVLayout, comm: Any, timeout_s: float, times: PathTimes) -> None:
    """DE side of the PE read path: wait for the PE to write every complete layer into the lease."""
    start = time.monotonic()
    for layer in range(layout.num_layers):
        wait_notify(
            comm,
            layer,
            plan.save_magics[layer],
            f"complete layer {layer} of request {plan.request_id} from the PE (PE read path)",
            abort_magic=plan.abort_to_de,
            timeout_s=timeout_s,
        )
    times.layers_s += time.monotonic() - start


def abort_peer(leg: LayerTransferLeg, peer: int, magic: int) -> str | None:
    """Best-effort abort flag to ``peer``; returns why it could not be set (the peer then times out)."""
    try:
        leg.record(peer, ABORT_SLOT, magic)
    except Exception as error:  # the link itself may be what failed
        return f"{type(error).__name__}: {error}"
    return None
