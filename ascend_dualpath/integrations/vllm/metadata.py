"""What the scheduler half tells the worker half each step (vLLM pickles it to the workers).

No vLLM import here, so the worker half runs (and is tested) without vLLM: ``connector.py`` registers
:class:`DualPathMetadata` as a virtual subclass of vLLM's ``KVConnectorMetadata`` (an empty ABC that vLLM only
names in type hints).
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
    """One step's work for the worker: loads (PE, standalone), saves (PE), receives (DE), persists."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    recvs: list[RecvSpec] = dataclasses.field(default_factory=list)
    persists: list[PersistSpec] = dataclasses.field(default_factory=list)
