"""Kernel settings of the normal ops as data: :class:`Config` and the tuned table per EP size.

DeepEP keeps one tuned ``Config`` per rank count behind ``Buffer.get_dispatch_config`` /
``get_combine_config``; so does this module (:data:`DISPATCH_CONFIGS`, :data:`COMBINE_CONFIGS`). A fresh
``Buffer.dispatch(..., config=...)`` fixes the settings of the plan it makes: that plan's cached dispatches and
its combine launch the kernels built for them. ``tools/tune_moe_copy.py`` measures candidate configs by passing
them, and its winners are written here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ascend_dualpath.errors import ConfigError

# The settings below are tuned on 2x H200 (tools/tune_moe_copy.py, 2026-11-30: the default row was within the
# noise of the best, see docs/benchmarks.md); 4 and 8 ranks reuse them until a 4/8-GPU machine measures its own.
EP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Config:
    """Tuning knobs of a normal dispatch/combine.

    Parameters
    ----------
    num_sms : int
        CTAs (one per SM) of the ``cuda`` strategy's copy kernels; 0 = the bandwidth model
        (:func:`ascend_dualpath.moe.strategies.cuda.choose_num_sms`); otherwise even.
    num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_send_tokens, \
num_max_rdma_chunked_recv_tokens : int
        DeepEP's chunk sizes, accepted so that ``Config(num_sms, 6, 256, 6, 128)`` ports unchanged; no strategy
        here streams chunks through a ring buffer, so they are not used.
    copy_block_words, copy_tile, copy_warps : int, keyword-only
        ``cuda`` copy kernels: each CTA iteration moves ``copy_tile`` rows of up to ``copy_block_words`` int32
        words with ``copy_warps`` warps (16 warps: 128 bytes in flight per thread).
    reduce_block, reduce_tile, reduce_warps : int, keyword-only
        ``cuda`` combine reduction: ``reduce_tile`` tokens x ``reduce_block`` elements per iteration.

    Notes
    -----
    Every field is validated at construction (:class:`~ascend_dualpath.errors.ConfigError` naming it).
    """

    num_sms: int = 0
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256
    copy_block_words: int = field(default=4096, kw_only=True)
    copy_tile: int = field(default=4, kw_only=True)
    copy_warps: int = field(default=16, kw_only=True)
    reduce_block: int = field(default=2048, kw_only=True)
    reduce_tile: int = field(default=4, kw_only=True)
    reduce_warps: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.num_sms, int) or self.num_sms < 0 or self.num_sms % 2:
            raise ConfigError(f"Config.num_sms={self.num_sms!r} must be 0 or a positive even int")
        for name in ("copy_block_words", "copy_tile", "copy_warps", "reduce_block", "reduce_tile", "reduce_warps"):
            value = getattr(self, name)
            # Triton block sizes and warp counts must be powers of two
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ConfigError(f"Config.{name}={value!r} must be a positive power of two")

    def with_num_sms(self, num_sms: int) -> Config:
        """This config with ``num_sms`` replaced."""
        return replace(self, num_sms=num_sms)


DISPATCH_CONFIGS: dict[int, Config] = {size: Config() for size in EP_SIZES}
COMBINE_CONFIGS: dict[int, Config] = {size: Config() for size in EP_SIZES}


def _lookup(table: dict[int, Config], num_ranks: int, what: str) -> Config:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"{what}: num_ranks={num_ranks!r} must be a positive int")
    # a rank count without its own entry takes the nearest tuned size at or above it (else the largest)
    size = min((s for s in table if s >= num_ranks), default=max(table))
    return table[size]


def dispatch_config(num_ranks: int) -> Config:
    """The tuned dispatch config for ``num_ranks`` ranks (:data:`DISPATCH_CONFIGS`)."""
    return _lookup(DISPATCH_CONFIGS, num_ranks, "dispatch_config")


def combine_config(num_ranks: int) -> Config:
    """The tuned combine config for ``num_ranks`` ranks (:data:`COMBINE_CONFIGS`)."""
    return _lookup(COMBINE_CONFIGS, num_ranks, "combine_config")
