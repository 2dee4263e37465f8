"""What the scheduler half tells the worker half each step (vLLM pickles it to the workers).

No vLLM import here, so the worker half runs (and is tested) without vLLM: ``connector.py`` registers
:class:`DualPathMetadata` as a virtual subclass of vLLM's ``KVConnectorMetadata`` (an empty ABC that vLLM only
names in type hints).
"""

from __future__ import annotations

import dataclasses

from ascend_dualpath.integrations.vllm.protocol import XferParams


@dataclasses.dataclass
class LoadSpec:
    """A synchronous layerwise load into this step's forward (the PE, or a standalone instance).

    Tokens ``[computed, hit_tokens)`` come from storage (PE read path) or from the DE (DE read path);
    ``block_ids`` is the request's whole block table; ``store_ids`` the store ids of its full prompt blocks.
    """

    req_id: str
    xfer: XferParams | None
    computed: int
    hit_tokens: int
    prompt_tokens: int
    store_ids: list[bytes]
    block_ids: list[int]


@dataclasses.dataclass
class SaveSpec:
    """Tokens ``[start, end)`` of a PE request computed in this step, to be sent to its DE."""

    req_id: str
    xfer: XferParams
    start: int
    end: int
    block_ids: list[int]


@dataclasses.dataclass
class RecvSpec:
    """An asynchronous receive on the DE: tokens ``[computed, end)`` of a ``prompt_tokens``-token prompt arrive into
    ``block_ids``.

    ``report`` False: the request takes nothing from its PE (its prompt ends inside the first block, or the DE's
    own prefix cache holds every row the PE would send) and vLLM does not wait for it; the PE still plans and
    sends, so the plan's lease is released once its rows ended, and vLLM is told nothing.
    """

    req_id: str
    xfer: XferParams
    computed: int
    end: int
    block_ids: list[int]
    prompt_tokens: int
    report: bool = True


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
