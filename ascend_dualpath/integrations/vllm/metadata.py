"""What the scheduler half tells the worker half each step, and what the worker half answers (vLLM pickles both).

No vLLM import here, so the worker half runs (and is tested) without vLLM: ``connector.py`` registers
:class:`DualPathMetadata` as a virtual subclass of vLLM's ``KVConnectorMetadata`` (an empty ABC that vLLM only
names in type hints) and :class:`DualPathWorkerMeta` of ``KVConnectorWorkerMetadata`` (``build_connector_worker_meta``
-> the scheduler's ``update_connector_output``).
"""

from __future__ import annotations

import dataclasses

from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec, SaveSpec


@dataclasses.dataclass
class PersistSpec:
    """A finished request's full blocks ``[first_block, len(store_ids))`` to write to storage.

    ``block_ids`` is the request's block table; the blocks stay allocated until the worker reports the
    request in ``finished_sending``.
    """

    req_id: str
    first_block: int
    store_ids: list[bytes]
    block_ids: list[int]


@dataclasses.dataclass
class DualPathMetadata:
    """One step's work for the worker: loads to read ahead of their step (``prefetches``: PE, standalone; their
    ``block_ids`` are empty), loads into this step (PE, standalone), saves (PE), receives (DE), persists."""

    prefetches: list[LoadSpec] = dataclasses.field(default_factory=list)
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    recvs: list[RecvSpec] = dataclasses.field(default_factory=list)
    persists: list[PersistSpec] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DualPathWorkerMeta:
    """A worker's answer after a step: ``ready`` maps each request whose read ahead ended since the last answer to
    the hit tokens its load may take (the good prefix); ``reports`` how many workers' answers each entry merges (1
    from one worker; an entry without one counts 1)."""

    ready: dict[str, int] = dataclasses.field(default_factory=dict)
    reports: dict[str, int] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: DualPathWorkerMeta) -> DualPathWorkerMeta:
        """vLLM merges its tensor-parallel workers' answers of one step: the shortest prefix any reports, and how
        many reported (a rank whose read ends a step later reports then: the scheduler waits for every rank's)."""
        merged, reports = dict(self.ready), {rid: self.reports.get(rid, 1) for rid in self.ready}
        for req_id, tokens in other.ready.items():
            merged[req_id] = min(tokens, merged.get(req_id, tokens))
            reports[req_id] = reports.get(req_id, 0) + other.reports.get(req_id, 1)
        return DualPathWorkerMeta(merged, reports)
