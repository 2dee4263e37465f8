"""What each half of an instance does for a request in one step (a host fills them from its own scheduler).

:class:`LoadSpec` and :class:`SaveSpec` go to the PE half (:mod:`~ascend_dualpath.dualpath.prefill_side`),
:class:`RecvSpec` to the DE half (:mod:`~ascend_dualpath.dualpath.decode_side`). Token positions index the
request's prompt; ``block_ids`` is the request's block table in the host's paged cache.
"""

from __future__ import annotations

import dataclasses

from ascend_dualpath.dualpath.side_channel import XferParams


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
