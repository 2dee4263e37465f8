"""Paged-KV layout adapters: one layer's vLLM paged cache <-> the library's token rows.

A token row is :class:`~ascend_dualpath.kv.layout.KVLayout` row bytes, ``uint8 [C]``: GQA field ``kv`` of
shape ``(2, kv_heads, head_dim)`` in the cache dtype (K then V), MLA field ``latent`` ``(latent_dim,)``.
An adapter reads and writes the rows of token positions ``[start, end)`` of one request, token ``t`` living
in block ``block_table[t // block_size]`` at offset ``t % block_size``. Block ids index dim 0 of the cache
tensor the adapter is given (vLLM's *kernel* blocks; equal to the scheduler's blocks unless vLLM splits a
manager block into kernel blocks). Every copy is one vectorized gather or ``index_put_`` over views of the
cache, so ``write_tokens`` changes exactly the bytes of the written tokens. Every adapter but ``CPU_ATTN`` (whose
pages permute elements per ISA) copies through the ``ascend_dualpath::kv_gather_tokens`` / ``kv_scatter_tokens``
ops on a ``[num_blocks, block_size, *row]`` view of the cache.

Layouts, as vLLM 0.32.0 hands each layer's cache to a KV connector (``register_kv_caches``; the per-layer
tensor is the logical 4-D view ``[num_blocks, H, N, C]`` that ``vllm.v1.kv_cache_interface.create_kv_cache_views``
cuts out of the raw buffer, with strides set by the resolved ``KVCacheLayout``):

- ``CPU_ATTN`` (``vllm/v1/attention/backends/cpu_attn.py``): ``[num_blocks, kv_heads, block_size, 2 * head_size]``,
  ``KVCacheLayout.LBHNC`` (the only layout the backend accepts). The last two dims are *not* ``(token, K|V)``:
  the backend views each ``(block, head)`` page as ``[2 * block_size, head_size]`` and splits it in half
  (``kv_cache.view(B, H, 2N, -1).chunk(2, dim=2)``), so the page holds a K region then a V region of
  ``block_size * head_size`` elements each, and inside a region the C++ op ``torch.ops._C.cpu_attn_reshape_and_cache``
  packs elements per ISA (``csrc/cpu/cpu_attn_vec.hpp``, ``cpu_attn_vec16.hpp``, ``cpu_attn_amx.hpp``):

  * ``vec`` / ``vec16``: K column-major ``[head_size, block_size]``, V row-major ``[block_size, head_size]``;
  * ``amx``: K in groups of 16 tokens, each group ``[head_size / e, 16, e]`` with ``e = 4 / itemsize`` elements
    per 4-byte word; V in groups of 16 head dims, each ``[block_size / e, 16, e]`` (tokens packed ``e`` to a word).

  The ISA is what vLLM picks per attention layer (``Attention.isa``, from ``cpu_attn._get_attn_isa(model dtype,
  block_size, head_size, cache dtype)``: ``amx`` for bf16 on AMX machines, ``vec16`` for head sizes that are
  multiples of 16 but not 32, else ``vec``). The tests check every ISA against vLLM's own op.
- ``FLASH_ATTN``, ``TRITON_ATTN`` (``flash_attn.py``, ``triton_attn.py``): logical ``[num_blocks, kv_heads, block_size,
  2 * head_size]`` with K then V on the last dim (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), any
  physical order (``LBNHC`` = NHD by default, ``LBHNC`` = HND, or block-outer layouts). 0.32.0 has no
  ``[2, num_blocks, ...]`` tensor any more; the adapter indexes the logical view, so strides do not matter.
- MLA backends (``CPU_MLA``, ``TRITON_MLA``, ``FLASHMLA``, ``FLASH_ATTN_MLA``, ``CUTLASS_MLA``, ``FLASHINFER_MLA``):
  ``[num_blocks, 1, block_size, latent_dim]`` (or the squeezed ``[num_blocks, block_size, latent_dim]`` an MLA
  layer binds, ``mla_attention.py``), latent = 512 compressed KV then 64 RoPE key for DeepSeek; BF16/FP16/FP32
  caches only (FP8 MLA caches pack scales and are not this layout).
- vllm-ascend ``CUSTOM`` (``AscendAttentionBackend.get_name()``, ``vllm_ascend/attention/attention_v1.py``): a
  tuple ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_size]``
  (``model_runner_v1._reshape_kv_cache_tensors``); ``ASCEND_MLA``: a tuple ``(nope_cache, rope_cache)``,
  ``[num_blocks, block_size, 1, 512]`` and ``[..., 64]``, whose concatenation is the latent.

Adapters hold the geometry validated by their ``from_cache``; every layer of one KV cache group shares it, so
one adapter serves all layers (each call checks the given layer's tensor matches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from ascend_dualpath import ops
from ascend_dualpath.errors import BoundsError, ConfigError
from ascend_dualpath.kv.layout import KVLayout

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_ISAS = ("vec", "vec16", "amx")
# AMX B tiles are 16 columns of 4-byte words (csrc/cpu/cpu_attn_amx.hpp: AMX_TILE_ROW_BYTES / 4).
_AMX_COLUMNS = 16
_AMX_ROW_BYTES = 64

Cache = torch.Tensor | tuple[torch.Tensor, ...]


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in CACHE_DTYPES:
        raise ConfigError(f"{name} cache dtype must be one of {[str(d) for d in CACHE_DTYPES]}, got {tensor.dtype}")


def _check_shape(name: str, tensor: torch.Tensor, expected: str, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ConfigError(f"{name} cache must be {expected} ({ndim} dims), got shape {list(tensor.shape)}")


class PagedKVAdapter:
    """Geometry of one backend's per-layer paged cache and the token-row copies in and out of it.

    Subclasses set ``block_size``, ``num_blocks`` and the row shape, and implement ``_gather`` / ``_scatter``
    on typed rows ``dtype [n, *row_shape]``; this class turns block tables into slots and rows into bytes.
    """

    backend_names: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[str] = "gqa"

    def __init__(self, num_blocks: int, block_size: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.row_shape = row_shape
        self.dtype = dtype
        self._template = self.kv_layout(1)

    @classmethod
    def from_cache(cls, cache: Cache, **options) -> PagedKVAdapter:
        """Validate one layer's cache (shape, dtype, strides) and return its adapter; ConfigError names the rule."""
        raise NotImplementedError

    # -- the library's view of a token row ------------------------------------------------------------------
    def kv_layout(self, num_layers: int) -> KVLayout:
        """The :class:`KVLayout` of Full Blocks ``[num_layers, block_size, C]`` holding this cache's token rows."""
        if self.kind == "mla":
            return KVLayout.mla(num_layers, self.row_shape[0], self.dtype, block_tokens=self.block_size)
        _, kv_heads, head_dim = self.row_shape
        return KVLayout.gqa(num_layers, kv_heads, head_dim, self.dtype, block_tokens=self.block_size)

    @property
    def token_bytes(self) -> int:
        """C: bytes of one token row of one layer."""
        return self._template.token_bytes

    # -- copies ---------------------------------------------------------------------------------------------
    def read_tokens(self, cache: Cache, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Token rows of positions ``[start, end)``: ``uint8 [end - start, C]`` (a fresh tensor)."""
        self._check_cache(cache)
        blocks, offsets = self._slots(block_table, start, end)
        typed = self._gather(cache, blocks, offsets).contiguous()
        return typed.view(torch.uint8).reshape(end - start, self.token_bytes)

    def write_tokens(self, cache: Cache, block_table: Sequence[int], start: int, rows: torch.Tensor) -> None:
        """Write ``uint8 [n, C]`` token rows into positions ``[start, start + n)``; no other cache byte changes."""
        self._check_cache(cache)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.token_bytes:
            raise ConfigError(f"rows must be uint8 [n, {self.token_bytes}], got {rows.dtype} {list(rows.shape)}")
        blocks, offsets = self._slots(block_table, start, start + rows.shape[0])
        field = self._template.fields[0].name
        typed = self._template.field_view(rows.contiguous(), field)
        self._scatter(cache, blocks, offsets, typed.to(self._device(cache)))

    # -- helpers ----------------------------------------------------------------------------------------------
    def _slots(self, block_table: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks and in-block offsets ``int64 [end - start]`` of positions ``[start, end)``."""
        table = torch.as_tensor(block_table, dtype=torch.int64).reshape(-1)
        capacity = table.numel() * self.block_size
        if not 0 <= start <= end <= capacity:
            raise BoundsError(
                f"token range [{start}, {end}) must lie in [0, {capacity}) "
                f"({table.numel()} blocks of {self.block_size} tokens)"
            )
        used = table[start // self.block_size : -(-end // self.block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= self.num_blocks):
            bad = used[(used < 0) | (used >= self.num_blocks)][0]
            raise BoundsError(f"block id {int(bad)} out of range [0, {self.num_blocks})")
        if torch.unique(used).numel() != used.numel():
            raise ConfigError(f"block table repeats a block id among {used.tolist()}")
        positions = torch.arange(start, end, dtype=torch.int64)
        return table[positions // self.block_size], positions % self.block_size

    def _device(self, cache: Cache) -> torch.device:
        return (cache[0] if isinstance(cache, tuple) else cache).device

    def _check_cache(self, cache: Cache) -> None:
        raise NotImplementedError

    def _gather(self, cache: Cache, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _scatter(self, cache: Cache, blocks: torch.Tensor, offsets: torch.Tensor, typed: torch.Tensor) -> None:
        raise NotImplementedError

    def _expect(self, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype:
            raise ConfigError(
                f"{what} must be {self.dtype} {list(shape)} like the cache this adapter was built from, "
                f"got {tensor.dtype} {list(tensor.shape)}"
            )


class CpuAttnAdapter(PagedKVAdapter):
    """vLLM CPU attention: ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K region then V region per page,
    each packed as the ISA's ``reshape_and_cache`` does (module docstring)."""

    backend_names = ("CPU_ATTN",)

    def __init__(self, num_blocks: int, kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, isa: str):
        super().__init__(num_blocks, block_size, (2, kv_heads, head_size), dtype)
        self.isa = isa
        self.shape = (num_blocks, kv_heads, block_size, 2 * head_size)
        self._positions = self._page_positions(block_size, head_size, dtype.itemsize, isa)

    @classmethod
    def from_cache(cls, cache: Cache, *, isa: str) -> CpuAttnAdapter:
        """``isa``: the ISA vLLM uses for this layer (``Attention.isa``), one of ``CPU_ISAS``."""
        name = "CPU_ATTN"
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"{name} cache must be one tensor, got {type(cache).__name__}")
        _check_shape(name, cache, "[num_blocks, kv_heads, block_size, 2 * head_size]", 4)
        _check_dtype(name, cache)
        num_blocks, kv_heads, block_size, width = cache.shape
        if width % 2:
            raise ConfigError(f"{name} cache last dim must be 2 * head_size (even), got {width}")
        if cache.stride(3) != 1 or cache.stride(2) != width:
            # vLLM itself views each page as [2 * block_size, head_size]; that needs a dense page.
            raise ConfigError(
                f"{name} cache pages must be dense ([block_size, 2 * head_size] contiguous), "
                f"got strides {cache.stride()}"
            )
        if isa not in CPU_ISAS:
            raise ConfigError(f"{name} isa must be one of {CPU_ISAS}, got {isa!r}")
        if isa == "amx":
            per_word = 4 // cache.dtype.itemsize
            tokens_per_tile = _AMX_ROW_BYTES // cache.dtype.itemsize
            if (width // 2) % _AMX_COLUMNS or block_size % tokens_per_tile or block_size % per_word:
                raise ConfigError(
                    f"{name} isa 'amx' needs head_size % {_AMX_COLUMNS} == 0 and block_size % {tokens_per_tile} == 0 "
                    f"for {cache.dtype}, got head_size {width // 2}, block_size {block_size}"
                )
        return cls(num_blocks, kv_heads, block_size, width // 2, cache.dtype, isa)

    @staticmethod
    def _page_positions(block_size: int, head_size: int, itemsize: int, isa: str) -> torch.Tensor:
        """Element offset inside a ``(block, head)`` page of every ``(token offset, K|V, head dim)``: ``int64 [N, 2, D]``."""
        token = torch.arange(block_size, dtype=torch.int64)[:, None]
        dim = torch.arange(head_size, dtype=torch.int64)[None, :]
        if isa == "amx":
            per_word = 4 // itemsize
            words = head_size // per_word
            key = (
                (token // _AMX_COLUMNS) * _AMX_COLUMNS * words + (dim // per_word) * _AMX_COLUMNS + token % _AMX_COLUMNS
            ) * per_word + dim % per_word
            value = (
                (dim // _AMX_COLUMNS) * block_size * _AMX_COLUMNS
                + (token // per_word) * per_word * _AMX_COLUMNS
                + (dim % _AMX_COLUMNS) * per_word
                + token % per_word
            )
        else:
            key = dim * block_size + token
            value = token * head_size + dim
        return torch.stack((key, value + block_size * head_size), dim=1)

    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"CPU_ATTN cache must be one tensor, got {type(cache).__name__}")
        self._expect(cache, self.shape, "CPU_ATTN cache")

    def _index(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor):
        pages = cache.view(self.num_blocks, self.shape[1], -1)  # [B, H, 2 * N * D], a view of the same bytes
        heads = torch.arange(self.shape[1], dtype=torch.int64, device=cache.device)[None, None, :, None]
        positions = self._positions.to(cache.device)[offsets][:, :, None, :]  # [n, 2, 1, D]
        return pages, (blocks.to(cache.device)[:, None, None, None], heads, positions)

    def _gather(self, cache, blocks, offsets):
        pages, index = self._index(cache, blocks, offsets)
        return pages[index]  # [n, 2, H, D]

    def _scatter(self, cache, blocks, offsets, typed):
        pages, index = self._index(cache, blocks, offsets)
        pages.index_put_(index, typed)


class FlashAttnAdapter(PagedKVAdapter):
    """vLLM FLASH_ATTN / TRITON_ATTN: logical ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K then V on
    the last dim, any strides."""

    backend_names = ("FLASH_ATTN", "TRITON_ATTN")

    def __init__(self, num_blocks: int, kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype):
        super().__init__(num_blocks, block_size, (2, kv_heads, head_size), dtype)
        self.shape = (num_blocks, kv_heads, block_size, 2 * head_size)

    @classmethod
    def from_cache(cls, cache: Cache) -> FlashAttnAdapter:
        name = "FLASH_ATTN"
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"{name} cache must be one tensor, got {type(cache).__name__}")
        _check_shape(name, cache, "[num_blocks, kv_heads, block_size, 2 * head_size]", 4)
        _check_dtype(name, cache)
        num_blocks, kv_heads, block_size, width = cache.shape
        if width % 2:
            raise ConfigError(f"{name} cache last dim must be 2 * head_size (even), got {width}")
        return cls(num_blocks, kv_heads, block_size, width // 2, cache.dtype)

    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"FLASH_ATTN cache must be one tensor, got {type(cache).__name__}")
        self._expect(cache, self.shape, "FLASH_ATTN cache")

    def _gather(self, cache, blocks, offsets):
        # [B, N, H, 2D] view, token dim second as the op takes it
        picked = ops.kv_gather_tokens(cache.transpose(1, 2), blocks.to(cache.device), offsets.to(cache.device))
        return picked.unflatten(-1, (2, -1)).transpose(1, 2)  # [n, 2, H, D]

    def _scatter(self, cache, blocks, offsets, typed):
        packed = typed.transpose(1, 2).flatten(-2)  # [n, H, 2D]
        ops.kv_scatter_tokens(cache.transpose(1, 2), blocks.to(cache.device), offsets.to(cache.device), packed)


class MlaAdapter(PagedKVAdapter):
    """vLLM MLA backends: ``[num_blocks, 1, block_size, latent_dim]`` or ``[num_blocks, block_size, latent_dim]``."""

    backend_names = ("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA")
    kind = "mla"

    def __init__(self, num_blocks: int, block_size: int, latent_dim: int, dtype: torch.dtype, ndim: int):
        super().__init__(num_blocks, block_size, (latent_dim,), dtype)
        self.shape = (num_blocks, 1, block_size, latent_dim) if ndim == 4 else (num_blocks, block_size, latent_dim)

    @classmethod
    def from_cache(cls, cache: Cache) -> MlaAdapter:
        name = "MLA"
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"{name} cache must be one tensor, got {type(cache).__name__}")
        if cache.dim() == 4 and cache.shape[1] != 1:
            raise ConfigError(
                f"{name} cache [num_blocks, 1, block_size, latent_dim] needs 1 head slot, got shape {list(cache.shape)}"
            )
        if cache.dim() not in (3, 4):
            raise ConfigError(
                f"{name} cache must be [num_blocks, 1, block_size, latent_dim] or "
                f"[num_blocks, block_size, latent_dim], got shape {list(cache.shape)}"
            )
        _check_dtype(name, cache)
        return cls(cache.shape[0], cache.shape[-2], cache.shape[-1], cache.dtype, cache.dim())

    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"MLA cache must be one tensor, got {type(cache).__name__}")
        self._expect(cache, self.shape, "MLA cache")

    def _latents(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.squeeze(1) if cache.dim() == 4 else cache  # [B, N, latent], a view

    def _gather(self, cache, blocks, offsets):
        return ops.kv_gather_tokens(self._latents(cache), blocks.to(cache.device), offsets.to(cache.device))

    def _scatter(self, cache, blocks, offsets, typed):
        ops.kv_scatter_tokens(self._latents(cache), blocks.to(cache.device), offsets.to(cache.device), typed)


class AscendAttnAdapter(PagedKVAdapter):
    """vllm-ascend ``CUSTOM``: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_size]``."""

    backend_names = ("CUSTOM",)

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_size: int, dtype: torch.dtype):
        super().__init__(num_blocks, block_size, (2, kv_heads, head_size), dtype)
        self.shape = (num_blocks, block_size, kv_heads, head_size)

    @classmethod
    def from_cache(cls, cache: Cache) -> AscendAttnAdapter:
        name = "vllm-ascend CUSTOM"
        if not (isinstance(cache, tuple | list) and len(cache) == 2):
            raise ConfigError(f"{name} cache must be a (k_cache, v_cache) pair, got {type(cache).__name__}")
        key, value = cache
        _check_shape(name, key, "(k_cache, v_cache) of [num_blocks, block_size, kv_heads, head_size]", 4)
        _check_dtype(name, key)
        if tuple(value.shape) != tuple(key.shape) or value.dtype != key.dtype or value.device != key.device:
            raise ConfigError(
                f"{name} v_cache must match k_cache {key.dtype} {list(key.shape)}, "
                f"got {value.dtype} {list(value.shape)}"
            )
        return cls(*key.shape, key.dtype)

    def _check_cache(self, cache: Cache) -> None:
        if not (isinstance(cache, tuple | list) and len(cache) == 2):
            raise ConfigError(f"vllm-ascend CUSTOM cache must be a (k_cache, v_cache) pair, got {type(cache).__name__}")
        for part, what in zip(cache, ("k_cache", "v_cache"), strict=True):
            self._expect(part, self.shape, what)

    def _gather(self, cache, blocks, offsets):
        device = cache[0].device
        blocks, offsets = blocks.to(device), offsets.to(device)
        return torch.stack([ops.kv_gather_tokens(part, blocks, offsets) for part in cache], dim=1)  # [n, 2, H, D]

    def _scatter(self, cache, blocks, offsets, typed):
        device = cache[0].device
        blocks, offsets = blocks.to(device), offsets.to(device)
        for index, part in enumerate(cache):
            ops.kv_scatter_tokens(part, blocks, offsets, typed[:, index])


class AscendMlaAdapter(PagedKVAdapter):
    """vllm-ascend ``ASCEND_MLA``: ``(nope_cache, rope_cache)``, ``[num_blocks, block_size, 1, nope]`` and
    ``[..., rope]``; the latent row is nope then rope."""

    backend_names = ("ASCEND_MLA",)
    kind = "mla"

    def __init__(self, num_blocks: int, block_size: int, nope_dim: int, rope_dim: int, dtype: torch.dtype):
        super().__init__(num_blocks, block_size, (nope_dim + rope_dim,), dtype)
        self.nope_dim = nope_dim
        self.shapes = ((num_blocks, block_size, 1, nope_dim), (num_blocks, block_size, 1, rope_dim))

    @classmethod
    def from_cache(cls, cache: Cache) -> AscendMlaAdapter:
        name = "ASCEND_MLA"
        if not (isinstance(cache, tuple | list) and len(cache) == 2):
            raise ConfigError(f"{name} cache must be a (nope_cache, rope_cache) pair, got {type(cache).__name__}")
        nope, rope = cache
        for part in cache:
            _check_shape(name, part, "(nope_cache, rope_cache) of [num_blocks, block_size, 1, dim]", 4)
            _check_dtype(name, part)
        if nope.shape[:3] != rope.shape[:3] or nope.shape[2] != 1 or nope.dtype != rope.dtype:
            raise ConfigError(
                f"{name} nope and rope caches must share [num_blocks, block_size, 1] and dtype, "
                f"got {nope.dtype} {list(nope.shape)} and {rope.dtype} {list(rope.shape)}"
            )
        return cls(nope.shape[0], nope.shape[1], nope.shape[3], rope.shape[3], nope.dtype)

    def _check_cache(self, cache: Cache) -> None:
        if not (isinstance(cache, tuple | list) and len(cache) == 2):
            raise ConfigError(f"ASCEND_MLA cache must be a (nope_cache, rope_cache) pair, got {type(cache).__name__}")
        for part, shape, what in zip(cache, self.shapes, ("nope_cache", "rope_cache"), strict=True):
            self._expect(part, shape, what)

    def _gather(self, cache, blocks, offsets):
        device = cache[0].device
        blocks, offsets = blocks.to(device), offsets.to(device)
        return torch.cat([ops.kv_gather_tokens(part, blocks, offsets)[:, 0] for part in cache], dim=-1)  # [n, latent]

    def _scatter(self, cache, blocks, offsets, typed):
        device = cache[0].device
        blocks, offsets = blocks.to(device), offsets.to(device)
        nope, rope = cache
        ops.kv_scatter_tokens(nope, blocks, offsets, typed[:, None, : self.nope_dim])
        ops.kv_scatter_tokens(rope, blocks, offsets, typed[:, None, self.nope_dim :])


ADAPTERS: tuple[type[PagedKVAdapter], ...] = (
    CpuAttnAdapter,
    FlashAttnAdapter,
    MlaAdapter,
    AscendAttnAdapter,
    AscendMlaAdapter,
)
_BY_NAME: dict[str, Callable[..., PagedKVAdapter]] = {
    name: adapter.from_cache for adapter in ADAPTERS for name in adapter.backend_names
}


def adapter_for(backend_name: str, cache: Cache, **options) -> PagedKVAdapter:
    """The adapter of vLLM attention backend ``backend_name`` (its ``get_name()``) for one layer's ``cache``.

    ``options`` go to the adapter's ``from_cache`` (``isa=`` for ``CPU_ATTN``). Raises ConfigError for a backend
    without an adapter or a cache that does not match the backend's layout.
    """
    try:
        factory = _BY_NAME[backend_name]
    except KeyError:
        raise ConfigError(
            f"no paged-KV layout adapter for attention backend {backend_name!r}; known: {sorted(_BY_NAME)}"
        ) from None
    return factory(cache, **options)
