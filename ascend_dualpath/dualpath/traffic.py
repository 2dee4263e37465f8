"""Traffic classes and QoS: model collectives high, KV low (paper §5, §A.1).

DualPath sends every byte into or out of an accelerator through its paired compute NIC, so that the
NIC's arbitration is the one place where KV traffic yields to model traffic (EP all-to-all, TP/CP
collectives). Two classes, about 99:1, and the low class is never starved. This module expresses
that policy in each network's own terms:

* HCCL (RoCEv2): ``HcclCommConfig.hcclRdmaTrafficClass`` / ``hcclRdmaServiceLevel`` and the torch_npu
  ``pg_options.hccl_config`` keys ``qos_traffic_class`` / ``qos_service_level``. The TC is the IP ToS
  byte (a multiple of 4, at most 255; DSCP = TC / 4; HCCL default 132); the SL is the 802.1p priority
  (0..7; HCCL default 4) and must match the NIC's PFC priority.
* InfiniBand: the opensm VL-arbitration settings the paper uses.
* RoCE switches/NICs: DSCP -> traffic class map plus ETS weights.

and provides :class:`WeightedArbiter`, a deficit-weighted round-robin that the emulated NIC mirrors.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from ascend_dualpath.errors import ConfigError, PayloadTooLarge

HCCL_DEFAULT_TC = 132
HCCL_DEFAULT_SL = 4
TC_MAX = 255
SL_MAX = 7


class TrafficClass(enum.Enum):
    """The two classes DualPath separates."""

    MODEL = "model"  # EP all-to-all, TP/CP collectives: latency critical, high priority
    KV = "kv"  # storage reads, PE<->DE layer blocks, H2D/D2H of KV: bulk, low priority


def validate_traffic_class(tc: int) -> int:
    """Check an HCCL RDMA traffic class (RoCEv2 ToS byte): an int in [0, 255] and a multiple of 4."""
    if isinstance(tc, bool) or not isinstance(tc, int) or not 0 <= tc <= TC_MAX or tc % 4:
        raise ConfigError(f"RDMA traffic class must be an int in [0, {TC_MAX}] and a multiple of 4, got {tc!r}")
    return tc


def validate_service_level(sl: int) -> int:
    """Check an RDMA service level (802.1p priority): an int in [0, 7]."""
    if isinstance(sl, bool) or not isinstance(sl, int) or not 0 <= sl <= SL_MAX:
        raise ConfigError(f"RDMA service level must be an int in [0, {SL_MAX}], got {sl!r}")
    return sl


@dataclass(frozen=True)
class ClassQos:
    """One class's marking on every network kind, and its arbitration weight.

    ``traffic_class`` is the RoCEv2 ToS byte, ``service_level`` the 802.1p / IB SL, ``ib_vl`` the
    InfiniBand virtual lane, ``weight`` the share in weighted arbitration (relative to the other class).
    """

    traffic_class: int
    service_level: int
    ib_vl: int
    weight: int

    def __post_init__(self) -> None:
        validate_traffic_class(self.traffic_class)
        validate_service_level(self.service_level)
        if not 0 <= self.ib_vl <= 14:
            raise ConfigError(f"IB data VL must be in [0, 14], got {self.ib_vl}")
        if self.weight < 1:
            raise ConfigError(f"arbitration weight must be >= 1 (0 would starve the class), got {self.weight}")

    @property
    def dscp(self) -> int:
        """DSCP code point = the upper six bits of the ToS byte."""
        return self.traffic_class >> 2


@dataclass(frozen=True)
class QosPolicy:
    """The model/KV split. Defaults: model traffic keeps HCCL's defaults (TC 132 = DSCP 33, SL 4, the
    usual lossless PFC priority), KV gets TC 96 (DSCP 24) / SL 3 on a second lossless priority, IB VL 0
    vs VL 2 as in the paper's opensm table, and weights 99:1."""

    model: ClassQos = ClassQos(traffic_class=HCCL_DEFAULT_TC, service_level=HCCL_DEFAULT_SL, ib_vl=0, weight=99)
    kv: ClassQos = ClassQos(traffic_class=96, service_level=3, ib_vl=2, weight=1)

    def __post_init__(self) -> None:
        if self.model.service_level == self.kv.service_level or self.model.dscp == self.kv.dscp:
            raise ConfigError(
                f"model and KV traffic must differ in SL and DSCP to be separable, got SL "
                f"{self.model.service_level}/{self.kv.service_level}, DSCP {self.model.dscp}/{self.kv.dscp}"
            )
        if self.model.ib_vl == self.kv.ib_vl:
            raise ConfigError(f"model and KV traffic must use different IB VLs, both got {self.kv.ib_vl}")

    def of(self, traffic: TrafficClass) -> ClassQos:
        return self.model if traffic is TrafficClass.MODEL else self.kv

    def hccl_comm_config(self, traffic: TrafficClass) -> dict[str, int]:
        """``HcclCommConfig`` fields for a communicator carrying ``traffic``."""
        qos = self.of(traffic)
        return {"hcclRdmaTrafficClass": qos.traffic_class, "hcclRdmaServiceLevel": qos.service_level}

    def pg_options_hccl_config(self, traffic: TrafficClass) -> dict[str, int]:
        """torch_npu ``ProcessGroupHCCL.Options().hccl_config`` entries (these beat ``HCCL_RDMA_TC/SL``)."""
        qos = self.of(traffic)
        return {"qos_traffic_class": qos.traffic_class, "qos_service_level": qos.service_level}

    def hccl_env(self, traffic: TrafficClass) -> dict[str, str]:
        """The process-wide fallback: ``HCCL_RDMA_TC`` / ``HCCL_RDMA_SL`` values for ``traffic``."""
        qos = self.of(traffic)
        return {"HCCL_RDMA_TC": str(qos.traffic_class), "HCCL_RDMA_SL": str(qos.service_level)}

    def nic_sl_weights(self) -> list[int]:
        """Arbitration weight per service level 0..7 for the emulated NIC (``device.nic.sl_weights``):
        the two classes' weights at their SLs, 1 elsewhere."""
        weights = [1] * (SL_MAX + 1)
        weights[self.model.service_level] = self.model.weight
        weights[self.kv.service_level] = self.kv.weight
        return weights

    def roce_config(self) -> dict[str, Any]:
        """RoCE NIC/switch settings: DSCP -> priority map, PFC on both priorities, ETS weights in percent."""
        total = self.model.weight + self.kv.weight
        return {
            "dscp_to_priority": {self.model.dscp: self.model.service_level, self.kv.dscp: self.kv.service_level},
            "pfc_priorities": sorted({self.model.service_level, self.kv.service_level}),
            "ets_percent": {
                self.model.service_level: round(100 * self.model.weight / total),
                self.kv.service_level: 100 - round(100 * self.model.weight / total),
            },
        }


DEFAULT_POLICY = QosPolicy()


def comm_config_fields(traffic: TrafficClass, policy: QosPolicy = DEFAULT_POLICY) -> dict[str, int]:
    """The ``HcclCommConfig`` fields of a communicator carrying ``traffic``, as keyword arguments of the emulator's
    ``comm_config`` (and the names of CANN's struct): ``hcclRdmaTrafficClass`` / ``hcclRdmaServiceLevel``.

    Every communicator the library makes passes them: KV (the DualPath engines, the vLLM connector's dataplane)
    :attr:`TrafficClass.KV`, model collectives (the MoE ``aiv`` strategy) :attr:`TrafficClass.MODEL`. Explicit
    fields beat ``HCCL_RDMA_TC`` / ``HCCL_RDMA_SL``, so a process-wide variable cannot put KV into the model class.

        >>> comm_config_fields(TrafficClass.KV)
        {'hcclRdmaTrafficClass': 96, 'hcclRdmaServiceLevel': 3}
    """
    return policy.hccl_comm_config(traffic)


def hccl_pg_options(traffic: TrafficClass, policy: QosPolicy = DEFAULT_POLICY, *, options: Any = None) -> Any:
    """torch_npu ``ProcessGroupHCCL.Options`` for an HCCL process group carrying ``traffic``: pass it as
    ``dist.new_group(ranks, backend="hccl", pg_options=...)``.

    ``options`` (a ``ProcessGroupHCCL.Options``; None makes a new one, which imports torch_npu) keeps its other
    ``hccl_config`` entries (``hccl_buffer_size``, ``group_name``, ...); the class's ``qos_traffic_class`` /
    ``qos_service_level`` replace any there. ``hccl_config`` is assigned whole because torch_npu's property returns
    a copy (an item set on it would be lost).
    """
    if options is None:
        import torch_npu

        options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {**dict(options.hccl_config), **policy.pg_options_hccl_config(traffic)}
    return options


@dataclass(frozen=True)
class OpensmQos:
    """InfiniBand VL arbitration as configured in opensm (the paper's §A.1 values by default).

    Entries are ``(vl, weight)``; a weight unit is 64 bytes; ``high_limit`` is in 4 KiB units and bounds
    how much the high table may send before the low table gets a turn.
    """

    max_vls: int = 4
    high_limit: int = 240
    vlarb_high: tuple[tuple[int, int], ...] = ((0, 192), (1, 192), (2, 0), (3, 192))
    vlarb_low: tuple[tuple[int, int], ...] = ((0, 192), (1, 192), (2, 64), (3, 192))

    def opensm_lines(self) -> list[str]:
        """The ``opensm.conf`` lines."""

        def table(entries: tuple[tuple[int, int], ...]) -> str:
            return ",".join(f"{vl}:{weight}" for vl, weight in entries)

        return [
            f"qos_max_vls {self.max_vls}",
            f"qos_high_limit {self.high_limit}",
            f"qos_vlarb_high {table(self.vlarb_high)}",
            f"qos_vlarb_low {table(self.vlarb_low)}",
        ]

    def low_vl_min_share(self, low_vl: int) -> float:
        """Bandwidth fraction a VL served only by the low table is guaranteed while the high table is busy.

        The high table may send ``high_limit * 4 KiB`` before the low table sends its weight (64 B units);
        so ``low / (high + low)``. With the paper's values this is 4 KiB out of 964 KiB, about 0.4%.
        """
        low_weight = dict(self.vlarb_low).get(low_vl, 0)
        if low_weight == 0:
            raise ConfigError(f"VL {low_vl} has weight 0 in the low table and would starve")
        low_bytes = 64 * low_weight
        return low_bytes / (self.high_limit * 4096 + low_bytes)


@dataclass
class Packet:
    """One unit the arbiter hands out: its class, size in bytes and the caller's tag."""

    traffic: Hashable
    nbytes: int
    tag: Any = None


class WeightedArbiter:
    """Deficit-weighted round robin over traffic classes (a NIC egress port).

    Each class has a FIFO and a weight; visiting a backlogged class credits it ``quantum * weight``
    bytes and it sends head packets while its credit covers them. Over any busy period each class gets
    bandwidth in proportion to its weight (within one packet per round), and every class with weight
    >= 1 is served at least once per round: starvation-free. Deterministic; the C++ emulated NIC
    mirrors this exact interface (``enqueue``, ``next``).

    Parameters
    ----------
    weights : Mapping[Hashable, int]
        Class -> weight (>= 1). Visiting order is the mapping's order.
    quantum_bytes : int
        Credit per weight unit and round; at least the largest packet (``max_packet_bytes``) keeps
        service within one round.
    max_packet_bytes : int
        The MTU: larger enqueues raise :class:`PayloadTooLarge`.
    """

    def __init__(self, weights: Mapping[Hashable, int], quantum_bytes: int = 4096, max_packet_bytes: int = 4096):
        if not weights:
            raise ConfigError("arbiter needs at least one traffic class")
        for traffic, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                raise ConfigError(f"weight of class {traffic!r} must be an int >= 1, got {weight!r}")
        if quantum_bytes < 1 or max_packet_bytes < 1:
            raise ConfigError(f"quantum and MTU must be >= 1 byte, got {quantum_bytes} and {max_packet_bytes}")
        self._order = list(weights)
        self._credit_per_round = {traffic: quantum_bytes * weight for traffic, weight in weights.items()}
        self._max_packet = max_packet_bytes
        self._queues: dict[Hashable, deque[Packet]] = {traffic: deque() for traffic in self._order}
        self._deficit = dict.fromkeys(self._order, 0)
        self._cursor = 0
        self._credited = False
        self.sent_bytes = dict.fromkeys(self._order, 0)

    @classmethod
    def from_policy(cls, policy: QosPolicy, quantum_bytes: int = 4096, max_packet_bytes: int = 4096):
        """An arbiter over :class:`TrafficClass` with the policy's weights."""
        weights = {TrafficClass.MODEL: policy.model.weight, TrafficClass.KV: policy.kv.weight}
        return cls(weights, quantum_bytes=quantum_bytes, max_packet_bytes=max_packet_bytes)

    def enqueue(self, traffic: Hashable, nbytes: int, tag: Any = None) -> None:
        """Queue one packet of ``nbytes`` (1..MTU) on ``traffic``'s FIFO."""
        if traffic not in self._queues:
            raise ConfigError(f"unknown traffic class {traffic!r}; configured: {self._order}")
        if not 1 <= nbytes <= self._max_packet:
            raise PayloadTooLarge(f"packet of {nbytes} bytes outside [1, MTU={self._max_packet}]")
        self._queues[traffic].append(Packet(traffic, nbytes, tag))

    def pending_bytes(self, traffic: Hashable) -> int:
        return sum(packet.nbytes for packet in self._queues[traffic])

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def next(self) -> Packet | None:
        """The next packet to transmit, or None when every queue is empty."""
        if not len(self):
            return None
        while True:
            traffic = self._order[self._cursor]
            queue = self._queues[traffic]
            if not queue:
                self._deficit[traffic] = 0  # an idle class keeps no credit (DRR rule)
                self._advance()
                continue
            if not self._credited:
                self._deficit[traffic] += self._credit_per_round[traffic]
                self._credited = True
            if queue[0].nbytes <= self._deficit[traffic]:
                packet = queue.popleft()
                self._deficit[traffic] -= packet.nbytes
                self.sent_bytes[traffic] += packet.nbytes
                if not queue:
                    self._deficit[traffic] = 0
                    self._advance()
                return packet
            self._advance()

    def _advance(self) -> None:
        self._cursor = (self._cursor + 1) % len(self._order)
        self._credited = False
