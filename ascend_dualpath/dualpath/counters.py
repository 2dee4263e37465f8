"""What one instance's two halves count since it started (a host hands the increments to its metrics)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Counters:
    """What an instance counts since start; the vLLM host's metrics get the increments (its stats.py names each)."""

    loads_pe: int = 0
    loads_de: int = 0
    loads_split: int = 0  # requests whose hit blocks both storage NICs read
    split_blocks_pe: int = 0  # hit blocks of split requests read by the PE (k == n and k == 0 included)
    split_blocks_de: int = 0  # ... and by the DE
    fallbacks: int = 0
    takeovers: int = 0  # loads whose DE half failed and this PE read it through its own storage NIC instead
    failures: int = 0
    checksum_errors: int = 0
    persisted_blocks: int = 0
    quarantined_leases: int = 0  # host leases kept out of the pool: a late write might still reach them
    quarantined_slots: int = 0  # a failed load's window slots (and notify group) a late DE push might still reach
    reclaimed_leases: int = 0  # quarantined leases given back once nothing could reach them
    reclaimed_slots: int = 0
    expired_plans: int = 0  # plans no request took within the timeout (the DE refused it, or its client left)
    side_refused: int = 0  # side-channel frames refused unread: no token proof, replayed, cut, oversized, garbage
