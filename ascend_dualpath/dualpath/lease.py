"""Where every byte of one request's KV sits in the DE's lease: the one answer to every offset question.

A request of ``P`` prompt tokens, ``H`` of them stored hits (a multiple of the block tokens ``T``), on a model of
``L`` layers and ``C`` bytes per token and layer, holds ``L * P * C`` bytes in the decode instance's lease:

- **complete layers** ``[L, P, C]`` when the PE sends every row (the PE read path, or after any fallback);
- else the **hit Full Blocks** ``[H / T, L, T, C]`` (read from storage in their stored format, by the DE or, on
  a split, partly by the PE) **then the new rows** ``[L, P - H, C]`` the PE computed.

Both DualPath hosts (the demo engines and the vLLM connector) place, push and merge bytes through
:class:`LeaseLayout` only; the same layout serves the PE's hit buffer (its Full Blocks) and the DE's lease.
"""

from __future__ import annotations

import dataclasses

import torch

from ascend_dualpath.dualpath.transfer_leg import Segment
from ascend_dualpath.errors import BoundsError
from ascend_dualpath.kv.layout import KVLayout


@dataclasses.dataclass(frozen=True)
class LeaseLayout:
    """One request's lease: ``layout`` (L, T, C), ``prompt_tokens`` (P) and ``hit_tokens`` (H; 0 for complete
    layers). Offsets are in bytes from the lease's first byte."""

    layout: KVLayout
    prompt_tokens: int
    hit_tokens: int = 0

    def __post_init__(self) -> None:
        P, H, T = self.prompt_tokens, self.hit_tokens, self.layout.block_tokens
        if P < 0 or not 0 <= H <= P or H % T:
            raise BoundsError(f"a lease of {P} prompt tokens cannot hold {H} hit tokens in blocks of {T}")

    @classmethod
    def complete(cls, layout: KVLayout, prompt_tokens: int) -> LeaseLayout:
        """Complete layers ``[L, P, C]``: every row from the PE."""
        return cls(layout, prompt_tokens, 0)

    @classmethod
    def blocks(cls, layout: KVLayout, num_blocks: int) -> LeaseLayout:
        """Hit Full Blocks only (a PE's own hit buffer): ``[num_blocks, L, T, C]``."""
        tokens = num_blocks * layout.block_tokens
        return cls(layout, tokens, tokens)

    @property
    def nbytes(self) -> int:
        """``L * P * C``, at least 1 (an empty request still holds a lease)."""
        return max(1, self.layout.kv_bytes(self.prompt_tokens))

    @property
    def hit_blocks(self) -> int:
        return self.hit_tokens // self.layout.block_tokens

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def block_offset(self, block: int) -> int:
        """Offset of hit Full Block ``block`` (``0 <= block < H / T``; the PE's hit buffer uses it too)."""
        if not 0 <= block <= self.hit_blocks:
            raise BoundsError(f"hit block {block} of a lease with {self.hit_blocks} hit blocks")
        return block * self.layout.full_block_bytes

    def hit_layer_segments(self, base: int, layer: int, first: int = 0, last: int | None = None) -> list[Segment]:
        """Layer ``layer`` of hit blocks ``[first, last)`` at address ``base``, packed as ``[(last - first) * T, C]``
        rows at the destination (one Layer Block per segment)."""
        last = self.hit_blocks if last is None else last
        lb = self.layout.layer_block_bytes
        return [Segment(base + self.block_offset(b) + layer * lb, lb, (b - first) * lb) for b in range(first, last)]

    def rows_offset(self, layer: int, start: int) -> int:
        """Offset of row ``start`` of layer ``layer`` among the rows the PE sends: every row of complete layers,
        else the new rows (``start >= H``), which are contiguous per layer from there."""
        C, L, P, H = self.layout.token_bytes, self.layout.num_layers, self.prompt_tokens, self.hit_tokens
        if not 0 <= layer < L or not H <= start <= P:
            raise BoundsError(f"row {start} of layer {layer}: the PE sends rows [{H}, {P}) of layers [0, {L})")
        if H == 0:
            return (layer * P + start) * C
        return L * H * C + (layer * (P - H) + start - H) * C

    def hit_rows(self, lease: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the hit blocks of ``lease`` (``uint8 [nbytes]``) as ``uint8 [H, C]`` token rows (a
        copy when there is more than one block)."""
        blocks = self.layout.as_full_blocks(lease[: self.hit_blocks * self.layout.full_block_bytes], self.hit_blocks)
        return self.layout.layer_rows(blocks, layer)

    def new_rows(self, lease: torch.Tensor, layer: int, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of layer ``layer`` the PE sent, from ``lease`` (``uint8 [nbytes]``), as a
        ``uint8 [end - start, C]`` view (``H <= start <= end <= P``)."""
        C = self.layout.token_bytes
        offset = self.rows_offset(layer, start)
        if end < start or end > self.prompt_tokens:
            raise BoundsError(f"rows [{start}, {end}) of a lease of {self.prompt_tokens} prompt tokens")
        return lease[offset : offset + (end - start) * C].view(end - start, C)

    def layer_copies(self, base: int, dst: int, dst_tokens: int) -> list[tuple[int, int, int]]:
        """``(src_addr, dst_addr, nbytes)`` copies assembling the lease at ``base`` into a destination
        ``[L, dst_tokens, C]`` at ``dst`` (``dst_tokens >= P``): per layer, the hit Layer Blocks then the new rows,
        in token order; rows ``[P, dst_tokens)`` are not written."""
        C, P, H = self.layout.token_bytes, self.prompt_tokens, self.hit_tokens
        if dst_tokens < P:
            raise BoundsError(f"a destination of {dst_tokens} tokens per layer cannot take {P} prompt tokens")
        copies = []
        for layer in range(self.layout.num_layers):
            at = dst + layer * dst_tokens * C
            copies += [(s.src_addr, at + s.dst_offset, s.nbytes) for s in self.hit_layer_segments(base, layer)]
            if P > H:
                copies.append((base + self.rows_offset(layer, H), at + H * C, (P - H) * C))
        return copies
