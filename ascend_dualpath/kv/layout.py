"""KV block layouts: Full Blocks ``[L, T, C]`` in storage, Layer Blocks ``[T, C]`` in flight.

A layout describes the bytes one token contributes to one layer's KV cache (``C``, the *token row*),
split into typed fields. Blocks are plain ``uint8`` tensors; typed tensors are views of their rows, so
nothing here copies data:

- GQA/MHA: one field ``kv`` of shape ``(2, kv_heads, head_dim)`` (index 0 = K, 1 = V); MHA is GQA with
  ``kv_heads == heads``.
- MLA: one field ``latent`` of shape ``(latent_dim,)`` (576 = 512 compressed KV + 64 RoPE key in
  DeepSeek-V2/V3), BF16 or FP16.
- MLA FP8: ``nope`` (512 x float8_e4m3fn), ``scale`` (512/128 = 4 x float32, one per 128-wide tile) and
  ``rope`` (64 x bfloat16): 656 bytes per token, the FP8 cache format FlashMLA uses for DeepSeek-V3.2.

A Full Block is ``[L, T, C]`` with the layer as its outermost axis, so layer ``l``'s Layer Block is the
contiguous slice ``full[l]`` and concatenating the L Layer Blocks gives the Full Block byte for byte.
Block ids come from a hash chain over token ids (:func:`block_hashes`): a block's id covers its own
tokens *and* every token before it, so equal ids mean equal prefixes.

Tensor parallelism (:meth:`KVLayout.shard`, :class:`KVShard`): a token row is made of *units*, the pieces a
tensor-parallel rank holds whole (GQA: one KV head, i.e. its K and its V; MLA: the whole row, which every rank
holds). Rank ``r`` of ``t`` holds some units; its bytes of a Full Block are a list of byte ranges, and its own
blocks are ``[L, T, C_r]`` of only those bytes, in the same order. The storage format does not depend on ``t``:
stored blocks hold every unit, and the fingerprint knows nothing of the parallel layout.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ascend_dualpath import ops
from ascend_dualpath.errors import BoundsError, ConfigError

DEFAULT_BLOCK_TOKENS = 64
BLOCK_ID_BYTES = 16


@dataclass(frozen=True)
class KVField:
    """One typed field of a token row: ``shape`` elements of ``dtype`` at byte ``offset`` of the row."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    """Byte layout of a model's KV cache blocks.

    Parameters
    ----------
    kind : str
        ``"gqa"`` or ``"mla"`` (``"mla_fp8"`` for the FP8 + scales format).
    num_layers : int
        L, the number of attention layers whose KV a Full Block carries.
    fields : tuple of KVField
        The typed fields of one token row, in byte order, each aligned to its element size.
    block_tokens : int
        T, tokens per block (64 by default, the paper's figure).
    """

    kind: str
    num_layers: int
    fields: tuple[KVField, ...]
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not self.fields:
            raise ConfigError("a KV layout needs at least one field")
        cursor = 0
        for field in self.fields:
            if field.offset != cursor:
                raise ConfigError(
                    f"field {field.name!r} starts at byte {field.offset}, expected {cursor} (packed rows)"
                )
            if field.offset % field.dtype.itemsize:
                raise ConfigError(
                    f"field {field.name!r} at byte {field.offset} is not aligned to its {field.dtype} "
                    f"element size {field.dtype.itemsize}"
                )
            if field.numel < 1:
                raise ConfigError(f"field {field.name!r} has shape {field.shape}: needs >= 1 element")
            cursor += field.nbytes
        widest = max(field.dtype.itemsize for field in self.fields)
        if cursor % widest:
            raise ConfigError(f"token row of {cursor} bytes is not a multiple of the widest element ({widest} bytes)")

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def gqa(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> KVLayout:
        """GQA/MHA layout: token row = K and V of every KV head, ``(2, num_kv_heads, head_dim)`` of ``dtype``."""
        if num_kv_heads < 1 or head_dim < 1:
            raise ConfigError(f"num_kv_heads and head_dim must be >= 1, got {num_kv_heads} and {head_dim}")
        return cls("gqa", num_layers, (KVField("kv", dtype, (2, num_kv_heads, head_dim), 0),), block_tokens)

    @classmethod
    def mla(
        cls,
        num_layers: int,
        latent_dim: int = 576,
        dtype: torch.dtype = torch.bfloat16,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> KVLayout:
        """MLA layout: token row = one compressed latent of ``latent_dim`` elements (K and V share it)."""
        return cls("mla", num_layers, (KVField("latent", dtype, (latent_dim,), 0),), block_tokens)

    @classmethod
    def mla_fp8(
        cls,
        num_layers: int,
        nope_dim: int = 512,
        rope_dim: int = 64,
        scale_group: int = 128,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> KVLayout:
        """MLA FP8 layout: ``nope`` in float8_e4m3fn, one float32 ``scale`` per ``scale_group``, ``rope`` in bf16."""
        if nope_dim % scale_group:
            raise ConfigError(f"nope_dim {nope_dim} must be a multiple of scale_group {scale_group}")
        nope = KVField("nope", torch.float8_e4m3fn, (nope_dim,), 0)
        scale = KVField("scale", torch.float32, (nope_dim // scale_group,), nope.nbytes)
        rope = KVField("rope", torch.bfloat16, (rope_dim,), scale.offset + scale.nbytes)
        return cls("mla_fp8", num_layers, (nope, scale, rope), block_tokens)

    # -- sizes --------------------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> int:
        """C: bytes one token contributes to one layer."""
        last = self.fields[-1]
        return last.offset + last.nbytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one Layer Block ``[T, C]``."""
        return self.block_tokens * self.token_bytes

    @property
    def full_block_bytes(self) -> int:
        """Bytes of one Full Block ``[L, T, C]``."""
        return self.num_layers * self.layer_block_bytes

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of the KV of ``num_tokens`` tokens across all layers."""
        return num_tokens * self.num_layers * self.token_bytes

    def field(self, name: str) -> KVField:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(f"layout {self.kind!r} has no field {name!r}; fields: {[f.name for f in self.fields]}")

    # -- tensor-parallel shards --------------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        """Units of a token row that tensor-parallel ranks hold whole: GQA its KV heads, MLA 1 (the whole row)."""
        return self.fields[0].shape[1] if self.kind == "gqa" else 1

    def unit_segments(self, unit: int) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` within a token row of unit ``unit``'s bytes, in row order (GQA: its K, its V)."""
        if not 0 <= unit < self.num_units:
            raise BoundsError(f"unit {unit} out of range [0, {self.num_units})")
        if self.kind != "gqa":
            return ((0, self.token_bytes),)
        kv = self.fields[0]
        head_bytes = kv.shape[2] * kv.dtype.itemsize
        return ((unit * head_bytes, head_bytes), ((kv.shape[1] + unit) * head_bytes, head_bytes))

    def shard(self, size: int, rank: int) -> KVShard:
        """What tensor-parallel rank ``rank`` of ``size`` holds of this layout's rows (see :class:`KVShard`)."""
        return KVShard(self, size, rank)

    def fingerprint(self) -> bytes:
        """Stable 16-byte digest of the layout; stored with every block so a store never mixes layouts."""
        text = f"{self.kind}|L={self.num_layers}|T={self.block_tokens}|" + "|".join(
            f"{f.name}:{f.dtype}:{f.shape}:{f.offset}" for f in self.fields
        )
        return hashlib.blake2b(text.encode(), digest_size=BLOCK_ID_BYTES).digest()

    # -- block tensors and views ----------------------------------------------------------------------------------
    def empty_full_blocks(self, num_blocks: int) -> torch.Tensor:
        """Fresh ``uint8 [num_blocks, L, T, C]`` storage for Full Blocks (contents undefined)."""
        return torch.empty((num_blocks, self.num_layers, self.block_tokens, self.token_bytes), dtype=torch.uint8)

    def as_full_blocks(self, raw: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
        """View flat or shaped ``uint8`` bytes as Full Blocks ``[n, L, T, C]`` without copying.

        Parameters
        ----------
        raw : torch.Tensor
            Contiguous ``uint8`` tensor of ``n * full_block_bytes`` bytes (any shape).
        num_blocks : int, optional
            n; inferred from ``raw.numel()`` when omitted.
        """
        if raw.dtype != torch.uint8:
            raise TypeError(f"block bytes must be torch.uint8, got {raw.dtype}")
        if not raw.is_contiguous():
            raise ValueError("block bytes must be contiguous to be viewed as Full Blocks")
        if num_blocks is None:
            num_blocks, remainder = divmod(raw.numel(), self.full_block_bytes)
            if remainder:
                raise BoundsError(
                    f"{raw.numel()} bytes is not a whole number of Full Blocks of {self.full_block_bytes} bytes"
                )
        needed = num_blocks * self.full_block_bytes
        if raw.numel() != needed:
            raise BoundsError(f"{num_blocks} Full Blocks need {needed} bytes, got {raw.numel()}")
        return raw.view(num_blocks, self.num_layers, self.block_tokens, self.token_bytes)

    def layer_block(self, full_blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer`` of Full Blocks, as a view: ``[L, T, C] -> [T, C]`` or ``[n, L, T, C] -> [n, T, C]``."""
        if not 0 <= layer < self.num_layers:
            raise BoundsError(f"layer {layer} out of range [0, {self.num_layers})")
        expected_tail = (self.num_layers, self.block_tokens, self.token_bytes)
        if full_blocks.dim() not in (3, 4) or tuple(full_blocks.shape[-3:]) != expected_tail:
            raise ValueError(
                f"Full Blocks must be [L, T, C] or [n, L, T, C] with [L, T, C] = {list(expected_tail)}, "
                f"got {list(full_blocks.shape)}"
            )
        return full_blocks.select(-3, layer)

    def field_view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """Typed view of field ``name`` in token rows: ``uint8 [..., C] -> dtype [..., *field.shape]``, no copy."""
        field = self.field(name)
        if rows.dtype != torch.uint8 or rows.shape[-1] != self.token_bytes:
            raise ValueError(f"token rows must be uint8 [..., {self.token_bytes}], got {rows.dtype} {list(rows.shape)}")
        if rows.stride(-1) != 1:
            raise ValueError("token rows must be contiguous in their last (byte) dimension")
        window = rows.narrow(-1, field.offset, field.nbytes)
        typed = window.view(field.dtype)
        return typed.unflatten(-1, field.shape)

    def encode_rows(self, **fields: torch.Tensor) -> torch.Tensor:
        """Pack typed fields into fresh token rows.

        Parameters
        ----------
        **fields : torch.Tensor
            One tensor per layout field, ``field.dtype [..., *field.shape]``, all with the same leading shape.

        Returns
        -------
        torch.Tensor
            ``uint8 [..., C]`` rows on the fields' device such that ``field_view(rows, name)`` equals
            ``fields[name]`` bit for bit (the ``ascend_dualpath::kv_encode_rows`` op).
        """
        missing = {f.name for f in self.fields} ^ set(fields)
        if missing:
            raise KeyError(
                f"encode_rows needs exactly the fields {[f.name for f in self.fields]}, got {sorted(fields)}"
            )
        leading: tuple[int, ...] | None = None
        for field in self.fields:
            value = fields[field.name]
            if value.dtype != field.dtype:
                raise TypeError(f"field {field.name!r} must be {field.dtype}, got {value.dtype}")
            if tuple(value.shape[value.dim() - len(field.shape) :]) != field.shape:
                raise ValueError(f"field {field.name!r} must end in shape {field.shape}, got {list(value.shape)}")
            lead = tuple(value.shape[: value.dim() - len(field.shape)])
            if leading is not None and lead != leading:
                raise ValueError(f"field {field.name!r} has leading shape {lead}, other fields have {leading}")
            leading = lead
        values = [fields[field.name] for field in self.fields]
        return ops.kv_encode_rows(values, [len(field.shape) for field in self.fields])

    def full_blocks_from_layers(self, layer_rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pack per-layer token rows into fresh Full Blocks.

        Parameters
        ----------
        layer_rows : sequence of torch.Tensor
            L tensors ``uint8 [n * T, C]``: layer ``l``'s rows for ``n`` whole blocks of tokens.

        Returns
        -------
        torch.Tensor
            ``uint8 [n, L, T, C]``; block ``b`` holds tokens ``[b*T, (b+1)*T)`` of every layer.
        """
        if len(layer_rows) != self.num_layers:
            raise ValueError(f"need rows for {self.num_layers} layers, got {len(layer_rows)}")
        num_tokens = layer_rows[0].shape[0]
        if num_tokens % self.block_tokens:
            raise BoundsError(f"{num_tokens} tokens is not a whole number of {self.block_tokens}-token blocks")
        stacked = torch.stack(list(layer_rows))  # [L, n*T, C]
        if tuple(stacked.shape[1:]) != (num_tokens, self.token_bytes) or stacked.dtype != torch.uint8:
            raise ValueError(f"layer rows must be uint8 [{num_tokens}, {self.token_bytes}], got {list(stacked.shape)}")
        num_blocks = num_tokens // self.block_tokens
        per_layer = stacked.view(self.num_layers, num_blocks, self.block_tokens, self.token_bytes)
        return per_layer.transpose(0, 1).contiguous()

    def layer_rows(self, full_blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer`` of ``[n, L, T, C]`` Full Blocks as ``[n * T, C]`` token rows (a copy when n > 1)."""
        return self.layer_block(full_blocks, layer).reshape(-1, self.token_bytes)

    def gqa_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of GQA token rows: ``uint8 [..., C] -> 2 x dtype [..., kv_heads, head_dim]``."""
        if self.kind != "gqa":
            raise ConfigError(f"gqa_kv needs a gqa layout, this one is {self.kind!r}")
        kv = self.field_view(rows, "kv")
        return kv.select(-3, 0), kv.select(-3, 1)


TP_SIZE_MAX = 1024  # far above any tensor-parallel size served; bounds the shard arithmetic


@dataclass(frozen=True)
class KVShard:
    """Tensor-parallel rank ``rank`` of ``size``'s part of a layout's token rows, as vLLM shards attention.

    GQA with ``kv_heads >= size`` (``kv_heads % size == 0``): heads ``[r * kv_heads / size, (r + 1) * kv_heads /
    size)``. GQA with ``kv_heads < size`` (``size % kv_heads == 0``): vLLM replicates heads, rank ``r`` holds head
    ``r * kv_heads // size``. MLA: every rank holds the whole latent.

    Attributes
    ----------
    units : range
        The units (GQA heads) the rank holds.
    local : KVLayout
        The rank's own rows: ``[L, T, C_r]`` blocks of only its bytes (GQA: a GQA layout of its heads; MLA: the
        full layout).
    """

    full: KVLayout
    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 1 <= self.size <= TP_SIZE_MAX:
            raise ConfigError(f"tensor-parallel size must be in [1, {TP_SIZE_MAX}], got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} out of range [0, {self.size})")
        heads = self.full.num_units
        if self.full.kind == "gqa" and heads % self.size and self.size % heads:
            raise ConfigError(
                f"{heads} KV heads cannot be sharded over tensor-parallel size {self.size}: one must divide the other"
            )

    @property
    def units(self) -> range:
        heads = self.full.num_units
        if self.full.kind != "gqa":
            return range(1)
        if heads >= self.size:
            per_rank = heads // self.size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        head = self.rank * heads // self.size
        return range(head, head + 1)

    @property
    def whole(self) -> bool:
        """Whether the rank holds every byte of a row (MLA, or GQA at size 1)."""
        return len(self.units) == self.full.num_units

    @property
    def local(self) -> KVLayout:
        if self.whole:
            return self.full
        kv = self.full.fields[0]
        return KVLayout.gqa(self.full.num_layers, len(self.units), kv.shape[2], kv.dtype, self.full.block_tokens)

    def row_segments(self) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` within a full token row of the rank's bytes, in the order of its local row
        (GQA: its heads' K, then their V), adjacent segments merged."""
        segments = [seg for unit in self.units for seg in self.full.unit_segments(unit)]
        segments.sort(key=lambda seg: seg[0])  # K of every held head precede their V: the local row's order
        return _merged(segments)

    def byte_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` within a Full Block ``[L, T, C]`` of the rank's bytes, in file order, adjacent ones
        merged; concatenated, they are the rank's local Full Block ``[L, T, C_r]``. Up to ``2 L T`` ranges (GQA: its
        heads' K and V of each row), computed once per shard: every read of a rank asks for them."""
        return _byte_ranges(self)

    def overlap(self, other: KVShard) -> tuple[tuple[int, int, int], ...]:
        """The units this rank and ``other`` (a rank of any size over the same layout) both hold, as ``(offset in
        this rank's local row, offset in other's local row, nbytes)`` segments, merged where contiguous in both: what
        one sends the other of each token row when the two sides' tensor-parallel sizes differ."""
        if other.full != self.full:
            raise ConfigError("shards of different layouts have nothing in common")
        segments = []
        for unit in range(max(self.units.start, other.units.start), min(self.units.stop, other.units.stop)):
            mine = self.local.unit_segments(unit - self.units.start)
            theirs = other.local.unit_segments(unit - other.units.start)
            segments += [(a, b, n) for (a, n), (b, _) in zip(mine, theirs, strict=True)]
        segments.sort()
        merged: list[list[int]] = []
        for a, b, n in segments:
            if merged and merged[-1][0] + merged[-1][2] == a and merged[-1][1] + merged[-1][2] == b:
                merged[-1][2] += n
            else:
                merged.append([a, b, n])
        return tuple((a, b, n) for a, b, n in merged)

    def sources(self, size: int) -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]:
        """Where this rank's units come from on a side of tensor-parallel size ``size``: ``(rank there, overlap
        segments as :meth:`overlap` gives them from this side)``, by rank, each unit from exactly one rank. Where that
        side holds a unit on several ranks (replicated GQA heads, MLA) it comes from the holder at this rank's
        position ``rank * size // self.size``, else the holder nearest to it: equal sizes pair rank ``r`` with rank
        ``r``, and the receiving ranks of a smaller size spread over the sending ranks of a larger one."""
        position = self.rank * size // self.size
        chosen = set()
        for unit in self.units:
            holders = [rank for rank in range(size) if unit in self.full.shard(size, rank).units]
            chosen.add(min(max(position, holders[0]), holders[-1]))
        return tuple((rank, self.overlap(self.full.shard(size, rank))) for rank in sorted(chosen))

    def targets(self, size: int, key: str | None = None) -> tuple[int, ...]:
        """The ranks of a side of tensor-parallel size ``size`` whose :meth:`sources` over this rank's size name this
        rank: those it sends its rows to (a PE rank's DE ranks; they send it the hit rows they read on the DE path).
        With a request's ``key``, only those that :meth:`lead` their replicas for it: the ranks this rank moves that
        request's rows with (none: a replica of this rank moves them, and this rank takes them from it)."""
        return tuple(
            rank
            for rank in range(size)
            if self.rank in (source for source, _ in self.full.shard(size, rank).sources(self.size))
            and (key is None or self.full.shard(size, rank).lead(key) == rank)
        )

    @functools.cached_property  # asked per request and per step; the shard never changes
    def replicas(self) -> tuple[int, ...]:
        """The ranks of this size that hold exactly this rank's units, itself included: every rank for MLA's latent,
        the ranks sharing its head where vLLM replicates GQA heads (``kv_heads < size``), else this rank alone."""
        return tuple(rank for rank in range(self.size) if self.full.shard(self.size, rank).units == self.units)

    @property
    def counts_requests(self) -> bool:
        """Whether this rank counts its instance's requests (loads, unfinished requests, blocks read): rank 0 and
        its :attr:`replicas`, each for the requests it :meth:`lead` s. Every rank moves its own units of every
        request, so counting on one replica group counts each request once per instance."""
        return 0 in self.replicas

    def lead(self, key: str, peer_size: int | None = None) -> int:
        """The one rank of :attr:`replicas` that reads and moves request ``key``'s rows; the others take them from it
        inside the instance, so a replicated unit is read from storage and sent between instances once.

        Without ``peer_size`` (a DE rank, or an instance with no peer) the replica at the key's CRC-32 modulo their
        number (requests spread over the ranks). A PE rank whose DE has tensor-parallel size ``peer_size``: the
        replica that is a source of the DE's lead rank for these units (each DE lead takes a unit from exactly one
        PE rank, :meth:`sources`), so the PE's and the DE's leads are a pair."""
        replicas = self.replicas
        if peer_size is None:
            return replicas[zlib.crc32(key.encode()) % len(replicas)]
        return next(rank for rank in replicas if self.full.shard(self.size, rank).targets(peer_size, key))

    def take(self, full_blocks: torch.Tensor) -> torch.Tensor:
        """The rank's bytes of Full Blocks: ``uint8 [..., L, T, C] -> [..., L, T, C_r]`` (a copy)."""
        if full_blocks.dtype != torch.uint8 or full_blocks.shape[-1] != self.full.token_bytes:
            raise ValueError(
                f"Full Blocks must be uint8 [..., {self.full.token_bytes}], got {full_blocks.dtype} "
                f"{list(full_blocks.shape)}"
            )
        return torch.cat([full_blocks.narrow(-1, off, n) for off, n in self.row_segments()], dim=-1)


@functools.lru_cache(maxsize=64)
def _byte_ranges(shard: KVShard) -> tuple[tuple[int, int], ...]:
    C, rows = shard.full.token_bytes, shard.full.num_layers * shard.full.block_tokens
    segments = shard.row_segments()
    return _merged([(row * C + offset, nbytes) for row in range(rows) for offset, nbytes in segments])


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint ``(offset, nbytes)`` ranges with touching neighbours joined."""
    merged: list[list[int]] = []
    for offset, nbytes in ranges:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1][1] += nbytes
        else:
            merged.append([offset, nbytes])
    return tuple((offset, nbytes) for offset, nbytes in merged)


def block_hashes(
    token_ids: Sequence[int] | torch.Tensor,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    namespace: bytes = b"",
) -> list[bytes]:
    """Hash chain of the full blocks of a token sequence.

    ``id_i = blake2b_128(id_{i-1} || tokens[i*T:(i+1)*T] as little-endian int64)`` with
    ``id_{-1} = blake2b_128(namespace)``. Only whole blocks are hashed; a trailing partial block has no id.
    Pass the layout's :meth:`KVLayout.fingerprint` (plus a model identity) as ``namespace`` so that two
    models never share block ids.

    Parameters
    ----------
    token_ids : sequence of int or torch.Tensor
        Token ids ``[N]``.
    block_tokens : int
        T, tokens per block.
    namespace : bytes
        Salt of the chain's root.

    Returns
    -------
    list of bytes
        ``N // T`` ids of 16 bytes each, id ``i`` covering tokens ``[0, (i+1)*T)``.
    """
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
    tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).contiguous()
    raw = tokens.numpy().astype("<i8", copy=False).tobytes()
    stride = block_tokens * 8
    parent = hashlib.blake2b(namespace, digest_size=BLOCK_ID_BYTES).digest()
    ids = []
    for start in range(0, (len(tokens) // block_tokens) * stride, stride):
        parent = hashlib.blake2b(parent + raw[start : start + stride], digest_size=BLOCK_ID_BYTES).digest()
        ids.append(parent)
    return ids
