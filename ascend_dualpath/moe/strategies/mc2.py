"""``mc2``: torch_npu's fused MoE dispatch/combine ops (``npu_moe_distribute_dispatch(_v2)`` / ``combine(_v2)``).

Not yet run on hardware: every rule below is taken from the op-plugin documentation and tested on the CPU
against a fake ``torch_npu`` module.

MC2's output is *expanded* (one row per (token, expert), grouped by local expert) with opaque combine metadata
(``expand_idx`` / ``assist_info_for_combine``), so it cannot fill DeepEP's packed ``[L, R·M, H]`` layout with
source indices. This strategy therefore offers the MC2 ops as :meth:`Mc2Strategy.dispatch_expanded` /
:meth:`Mc2Strategy.combine_expanded` (weighted combine, MC2's semantics), and runs the DeepEP-shaped ops of
:class:`~ascend_dualpath.moe.Buffer` over ``all_to_all_single`` on a **separate** HCCL group: the docs allow no
other operator on the communication domain of the MC2 ops. Every documented constraint is checked by
:func:`validate_dispatch` / :func:`validate_combine` (and the communication buffer by :func:`check_hccl_buffsize`)
before an op is called. The v2 ops are used where torch_npu has them, else v1 (``version="auto"``).

Limits (op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_*.md`` at commit 517f2e7, 2026-08;
A2 = Atlas A2, A3 = Atlas A3; BS tokens per rank, K top-k, E experts, L = E / (ep_world_size - shared expert
ranks) local experts, H hidden; ``comm_alg`` is resolved first, see :func:`resolve_comm_alg`):

=======  ====  ===========  ===================================  ====  ===  =====  =======================  ==========
version  prod  comm_alg     ep_world_size                        BS    K    E      H                        local rule
=======  ====  ===========  ===================================  ====  ===  =====  =======================  ==========
v1       A2    fullmesh     16, 32, 64                           256   16   512    (0, 7168], multiple of 32  L <= 24
v1       A2    hierarchy    16, 32, 64                           256   16   512    (0, 7168], multiple of 32  --
v1       A3    fullmesh_v1  8, 16, 32, 64, 128, 144, 256, 288    512   8    512    7168                     --
v2       A2    fullmesh     2-8, 16, 32, 64, 128, 256            256   16   1024   (0, 7168], multiple of 32  --
v2       A2    hierarchy    16, 32, 64                           512   16   1024   (0, 10240], multiple of 32 --
v2       A3    fullmesh_v1  [2, 768]                             512   16   1024   [1024, 8192]             L·R <= 2048
v2       A3    fullmesh_v2  [2, 768]                             256   12   1024   [1024, 8192]             L·R <= 2048
v2       A3    hierarchy    [16, 256], multiple of 16            256   16   512    [1024, 8192]             L·R <= 2048
=======  ====  ===========  ===================================  ====  ===  =====  =======================  ==========

v1 "hierarchy" on A2 is the mode ``HCCL_INTRA_PCIE_ENABLE=1`` + ``HCCL_INTRA_ROCE_ENABLE=0`` selects (v1 has no
``comm_alg`` argument). ``x_active_mask``: v1 none; v2 ``[BS]`` (a prefix of True) or ``[BS, K]``, except A2
hierarchy (none) and A3 hierarchy (``[BS]`` only). ``combine_v2`` on A3 takes ``comm_alg`` "" or "hierarchy" only.
Expert ids lie in ``[0, E)`` with no duplicate in a row (masked-off slots excepted); ``quant_mode`` is 0 or 2.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ascend_dualpath.dualpath.traffic import TrafficClass, hccl_pg_options
from ascend_dualpath.errors import BackendUnavailable, BoundsError, CapacityError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy

PRODUCTS = ("A2", "A3")
VERSIONS = ("v1", "v2")
QUANT_MODES = (0, 2)
MB = 1 << 20
DEFAULT_HCCL_BUFFSIZE_MB = 200  # CANN's default when HCCL_BUFFSIZE is unset
# the comm_alg values each op accepts, per product (v1 takes none)
DISPATCH_V2_COMM_ALGS = {"A2": ("", "fullmesh", "hierarchy"), "A3": ("", "fullmesh_v1", "fullmesh_v2", "hierarchy")}
COMBINE_V2_COMM_ALGS = {"A2": ("", "fullmesh", "hierarchy"), "A3": ("", "hierarchy")}
# torch_npu.npu.get_soc_version() codes per product (Ascend910B1..B4 variants; Ascend910_93xx)
SOC_VERSIONS = {"A2": range(220, 226), "A3": range(250, 256)}


@dataclass(frozen=True)
class Limits:
    """The documented limits of one (version, product, resolved comm_alg); see the module table."""

    ep_world_sizes: frozenset[int]
    max_tokens: int
    max_topk: int
    max_experts: int
    hidden: tuple[int, int]  # inclusive range
    hidden_multiple: int
    max_local_experts: int | None  # L <= this (A2 v1 fullmesh)
    max_local_times_world: int | None  # L * ep_world_size <= this (A3 v2)
    mask_dims: tuple[int, ...]  # accepted x_active_mask ranks; () = not supported


_A2_V1_WORLDS = frozenset({16, 32, 64})
_A3_V1_WORLDS = frozenset({8, 16, 32, 64, 128, 144, 256, 288})
_A2_V2_FULLMESH_WORLDS = frozenset({2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256})
_A3_V2_WORLDS = frozenset(range(2, 769))
_A3_V2_HIERARCHY_WORLDS = frozenset(range(16, 257, 16))
LIMITS: dict[tuple[str, str, str], Limits] = {
    ("v1", "A2", "fullmesh"): Limits(_A2_V1_WORLDS, 256, 16, 512, (1, 7168), 32, 24, None, ()),
    ("v1", "A2", "hierarchy"): Limits(_A2_V1_WORLDS, 256, 16, 512, (1, 7168), 32, None, None, ()),
    ("v1", "A3", "fullmesh_v1"): Limits(_A3_V1_WORLDS, 512, 8, 512, (7168, 7168), 1, None, None, ()),
    ("v2", "A2", "fullmesh"): Limits(_A2_V2_FULLMESH_WORLDS, 256, 16, 1024, (1, 7168), 32, None, None, (1, 2)),
    ("v2", "A2", "hierarchy"): Limits(_A2_V1_WORLDS, 512, 16, 1024, (1, 10240), 32, None, None, ()),
    ("v2", "A3", "fullmesh_v1"): Limits(_A3_V2_WORLDS, 512, 16, 1024, (1024, 8192), 1, None, 2048, (1, 2)),
    ("v2", "A3", "fullmesh_v2"): Limits(_A3_V2_WORLDS, 256, 12, 1024, (1024, 8192), 1, None, 2048, (1, 2)),
    ("v2", "A3", "hierarchy"): Limits(_A3_V2_HIERARCHY_WORLDS, 256, 16, 512, (1024, 8192), 1, None, 2048, (1,)),
}


def resolve_comm_alg(
    version: str, product: str, comm_alg: str = "", env: Mapping[str, str] | None = None, op: str = "dispatch"
) -> str:
    """The algorithm a call runs, as a key of :data:`LIMITS`.

    ``""`` means "fullmesh_v1" on A3; on A2 it means "hierarchy" where ``HCCL_INTRA_PCIE_ENABLE=1`` and
    ``HCCL_INTRA_ROCE_ENABLE=0`` are set in ``env`` (default ``os.environ``), else "fullmesh" (the only choice v1
    has). ``op`` is "dispatch" or "combine" (their v2 forms accept different ``comm_alg`` values on A3).
    """
    if product not in PRODUCTS:
        raise ConfigError(f"product={product!r} must be one of {PRODUCTS}")
    if version not in VERSIONS:
        raise ConfigError(f"version={version!r} must be one of {VERSIONS}")
    if version == "v1" and comm_alg:
        raise ConfigError(f"comm_alg={comm_alg!r} needs the v2 ops; the v1 ops take no comm_alg")
    accepted = (COMBINE_V2_COMM_ALGS if op == "combine" else DISPATCH_V2_COMM_ALGS)[product]
    if version == "v2" and comm_alg not in accepted:
        raise ConfigError(f"comm_alg={comm_alg!r} is not accepted by {op}_v2 on {product}; choose one of {accepted}")
    if comm_alg:
        return comm_alg
    if product == "A3":
        return "fullmesh_v1"
    env = os.environ if env is None else env
    intra_pcie = env.get("HCCL_INTRA_PCIE_ENABLE") == "1" and env.get("HCCL_INTRA_ROCE_ENABLE") == "0"
    return "hierarchy" if intra_pcie else "fullmesh"


def _check_shape(lim: Limits, key: tuple[str, str, str], tokens: int, hidden: int, topk: int) -> None:
    where = "MC2 {} on {} with comm_alg {!r}".format(*key)
    if not 0 < tokens <= lim.max_tokens:
        raise PayloadTooLarge(f"{where} takes 1 to {lim.max_tokens} tokens per rank, got {tokens}")
    if not 0 < topk <= lim.max_topk:
        raise ConfigError(f"{where} takes top-k in [1, {lim.max_topk}], got {topk}")
    low, high = lim.hidden
    if not low <= hidden <= high or hidden % lim.hidden_multiple:
        rule = f"[{low}, {high}]" if low < high else f"== {low}"
        multiple = f", a multiple of {lim.hidden_multiple}" if lim.hidden_multiple > 1 else ""
        raise ConfigError(f"{where} needs hidden {rule}{multiple}, got {hidden}")


def _check_experts(
    lim: Limits,
    key: tuple[str, str, str],
    topk: int,
    num_experts: int,
    ep_world_size: int,
    ep_rank_id: int,
    shared_expert_rank_num: int,
) -> None:
    where = "MC2 {} on {} with comm_alg {!r}".format(*key)
    if ep_world_size not in lim.ep_world_sizes:
        allowed = sorted(lim.ep_world_sizes)
        shown = ", ".join(map(str, allowed)) if len(allowed) <= 12 else f"{allowed[0]}..{allowed[-1]} (see table)"
        raise ConfigError(f"{where} takes ep_world_size in {{{shown}}}, got {ep_world_size}")
    if not 0 <= ep_rank_id < ep_world_size:
        raise ConfigError(f"ep_rank_id={ep_rank_id} must be in [0, ep_world_size={ep_world_size})")
    if not 0 <= shared_expert_rank_num < ep_world_size:
        raise ConfigError(f"shared_expert_rank_num={shared_expert_rank_num} must be in [0, {ep_world_size})")
    expert_ranks = ep_world_size - shared_expert_rank_num
    if not 1 <= num_experts <= lim.max_experts or num_experts % expert_ranks:
        raise ConfigError(
            f"{where} takes moe_expert_num in [1, {lim.max_experts}], a multiple of ep_world_size - "
            f"shared_expert_rank_num = {expert_ranks}; got {num_experts}"
        )
    if topk > num_experts:
        raise ConfigError(f"top-k {topk} exceeds moe_expert_num={num_experts}")
    local = num_experts // expert_ranks
    if lim.max_local_experts is not None and local > lim.max_local_experts:
        raise ConfigError(
            f"{where} takes <= {lim.max_local_experts} local experts, got {local} "
            f"({num_experts} experts over {expert_ranks} ranks)"
        )
    if lim.max_local_times_world is not None and local * ep_world_size > lim.max_local_times_world:
        raise ConfigError(
            f"{where} needs local experts x ep_world_size <= {lim.max_local_times_world}, got "
            f"{local} x {ep_world_size} = {local * ep_world_size}"
        )


def limits_for(
    version: str, product: str, comm_alg: str = "", env: Mapping[str, str] | None = None, op: str = "dispatch"
) -> tuple[tuple[str, str, str], Limits]:
    """``((version, product, resolved comm_alg), Limits)`` of a call; ConfigError for a combination not offered."""
    key = (version, product, resolve_comm_alg(version, product, comm_alg, env, op))
    if key not in LIMITS:
        raise ConfigError(f"MC2 {version} on {product} has no comm_alg {key[2]!r}")
    return key, LIMITS[key]


def _active_slots(
    expert_ids: torch.Tensor, x_active_mask: torch.Tensor | None, lim: Limits, key: tuple[str, str, str]
) -> torch.Tensor:
    """bool ``[BS, K]``: the slots that take part (all of them without a mask)."""
    if x_active_mask is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    where = "MC2 {} on {} with comm_alg {!r}".format(*key)
    if not lim.mask_dims:
        raise ConfigError(f"{where} takes no x_active_mask")
    shapes = {1: (expert_ids.shape[0],), 2: tuple(expert_ids.shape)}
    accepted = [list(shapes[d]) for d in lim.mask_dims]
    if x_active_mask.dtype != torch.bool or tuple(x_active_mask.shape) not in [tuple(a) for a in accepted]:
        raise ConfigError(
            f"{where} takes x_active_mask as bool of shape {' or '.join(map(str, accepted))}, got "
            f"{x_active_mask.dtype} {list(x_active_mask.shape)}"
        )
    if x_active_mask.dim() == 2:
        return x_active_mask
    if bool((x_active_mask[1:] & ~x_active_mask[:-1]).any()):
        raise ConfigError("a 1-D x_active_mask must be a prefix of True values")
    return x_active_mask.unsqueeze(1).expand_as(expert_ids)


def _check_ids(expert_ids: torch.Tensor, active: torch.Tensor, moe_expert_num: int) -> None:
    ids = expert_ids.long()
    bad = active & ((ids < 0) | (ids >= moe_expert_num))
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise BoundsError(
            f"MC2 expert id {value} is outside [0, moe_expert_num={moe_expert_num}) "
            f"(-1 is allowed only in slots masked off by x_active_mask)"
        )
    masked = torch.where(active, ids, -1 - torch.arange(ids.shape[1]).expand_as(ids))  # unique fillers
    sorted_ids = masked.sort(dim=1).values
    if bool((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any()):
        raise ConfigError("MC2 expert_ids must not repeat an expert within a token's row")


def validate_dispatch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    product: str = "A3",
    version: str = "v2",
    comm_alg: str = "",
    quant_mode: int = 0,
    x_active_mask: torch.Tensor | None = None,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    shared_expert_rank_num: int = 0,
    env: Mapping[str, str] | None = None,
) -> Limits:
    """Check the documented MC2 dispatch constraints; raise a specific error naming value and limit.

    Parameters
    ----------
    x : bf16/fp16 [BS, H]
    expert_ids : int32 [BS, K]
    x_active_mask : bool [BS] (a prefix of True: active tokens) or [BS, K] (active slots), v2 only
    env : the environment that resolves ``comm_alg=""`` on A2 (default ``os.environ``)

    Returns the :class:`Limits` the call was checked against.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"MC2 x must be bf16/fp16 [BS, H], got {x.dtype} {list(x.shape)}")
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ConfigError(
            f"MC2 expert_ids must be int32 [BS={x.shape[0]}, K], got {expert_ids.dtype} {list(expert_ids.shape)}"
        )
    key, lim = limits_for(version, product, comm_alg, env, "dispatch")
    tokens, hidden = x.shape
    _check_shape(lim, key, tokens, hidden, expert_ids.shape[1])
    _check_experts(lim, key, expert_ids.shape[1], moe_expert_num, ep_world_size, ep_rank_id, shared_expert_rank_num)
    if quant_mode not in QUANT_MODES:
        raise ConfigError(f"quant_mode={quant_mode} must be one of {QUANT_MODES} (0 none, 2 dynamic INT8)")
    if expert_token_nums_type not in (0, 1):
        raise ConfigError(f"expert_token_nums_type={expert_token_nums_type} must be 0 (prefix sums) or 1 (counts)")
    if global_bs and tokens > global_bs // ep_world_size:
        raise PayloadTooLarge(f"{tokens} tokens exceed global_bs / ep_world_size = {global_bs // ep_world_size}")
    _check_ids(expert_ids, _active_slots(expert_ids, x_active_mask, lim, key), moe_expert_num)
    return lim


def validate_combine(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_scales: torch.Tensor,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    product: str = "A3",
    version: str = "v2",
    comm_alg: str = "",
    shared_expert_rank_num: int = 0,
    env: Mapping[str, str] | None = None,
) -> Limits:
    """Check the documented MC2 combine constraints (shapes, dtypes, hidden range, scale shape).

    Parameters
    ----------
    expand_x : bf16/fp16 [A, H]
    expert_ids : int32 [BS, K]
    expert_scales : float32 [BS, K]
    """
    if expand_x.dim() != 2 or expand_x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"MC2 expand_x must be bf16/fp16 [A, H], got {expand_x.dtype} {list(expand_x.shape)}")
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 2:
        raise ConfigError(f"MC2 expert_ids must be int32 [BS, K], got {expert_ids.dtype} {list(expert_ids.shape)}")
    if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != tuple(expert_ids.shape):
        raise ConfigError(
            f"MC2 expert_scales must be float32 {list(expert_ids.shape)}, got {expert_scales.dtype} "
            f"{list(expert_scales.shape)}"
        )
    key, lim = limits_for(version, product, comm_alg, env, "combine")
    _check_shape(lim, key, expert_ids.shape[0], expand_x.shape[1], expert_ids.shape[1])
    _check_experts(lim, key, expert_ids.shape[1], moe_expert_num, ep_world_size, ep_rank_id, shared_expert_rank_num)
    return lim


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def _align480_512(x: int) -> int:
    """The docs' ``480Align512``: blocks of 480 payload bytes, each taking 512."""
    return -(-x // 480) * 512


def required_hccl_buffsize_mb(
    version: str,
    product: str,
    comm_alg: str,
    *,
    max_tokens: int,
    hidden: int,
    topk: int,
    moe_expert_num: int,
    ep_world_size: int,
    shared_expert_rank_num: int = 0,
    shared_expert_num: int = 1,
    x_itemsize: int = 2,
) -> int:
    """The smallest ``HCCL_BUFFSIZE`` (MB) the op docs require on the EP domain, for a resolved ``comm_alg``.

    ``max_tokens`` is the largest BS of any rank (``global_bs / ep_world_size``). ``shared_expert_num`` enters the
    A3 v2 formula even without shared-expert ranks (1 is the ops' default). Formulas of the module's docs, "/" as
    integer division, rounded up to whole MB.
    """
    local = moe_expert_num // (ep_world_size - shared_expert_rank_num)
    bs, h, k = max_tokens, hidden, topk
    row_words = 4 * _align(k, 8) * 4  # per-token routing words next to the hidden row
    if product == "A2" and comm_alg == "fullmesh":
        need = 2 * (bs * ep_world_size * min(local, k) * h * 2 + 2 * MB)
    elif product == "A2" and comm_alg == "hierarchy" and version == "v1":
        need = moe_expert_num * bs * (h * x_itemsize + row_words) + 4 * MB + 100 * MB
    elif product == "A2" and comm_alg == "hierarchy":
        need = (moe_expert_num + ep_world_size // 4) * _align(bs * (h * x_itemsize + row_words), 512) + 8 * MB
    elif version == "v1":  # A3: 1024^2 * (HCCL_BUFFSIZE - 2) / 2 >= BS * 2 * (H + 128) * (R * L + K + 1)
        return 2 + -(-2 * bs * 2 * (h + 128) * (ep_world_size * local + k + 1) // MB)
    elif comm_alg == "hierarchy":
        need = moe_expert_num * bs * (h * x_itemsize + row_words) + 4 * MB + 400 * MB
    else:  # A3 fullmesh_v1 / fullmesh_v2
        block = _align480_512 if comm_alg == "fullmesh_v2" else (lambda n: _align(n, 512))
        need = 2 * (
            local * bs * ep_world_size * block(_align(2 * h, 32) + 64)
            + (k + shared_expert_num) * bs * _align(2 * h, 512)
        )
        return max(2, -(-need // MB))
    return -(-need // MB)


def hccl_buffsize_mb(env: Mapping[str, str] | None = None) -> int:
    """``HCCL_BUFFSIZE`` from ``env`` (default ``os.environ``), CANN's 200 MB when unset."""
    env = os.environ if env is None else env
    raw = env.get("HCCL_BUFFSIZE", "")
    if not raw:
        return DEFAULT_HCCL_BUFFSIZE_MB
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"HCCL_BUFFSIZE={raw!r} must be an integer number of MB >= 1")
    return int(raw)


def check_hccl_buffsize(required_mb: int, configured_mb: int, what: str) -> None:
    """CapacityError when the communication buffer is smaller than the op docs require."""
    if configured_mb < required_mb:
        raise CapacityError(
            f"{what} needs HCCL_BUFFSIZE >= {required_mb} MB on its EP group, the group has "
            f"{configured_mb} MB (set HCCL_BUFFSIZE, or hccl_buffer_size in the group's options)"
        )


def op_version(torch_npu: Any, requested: str = "auto") -> str:
    """``"v2"`` or ``"v1"``: the requested one if this torch_npu has both its ops, ``auto`` = v2 where present."""
    have = {
        v: all(hasattr(torch_npu, f"npu_moe_distribute_{op}{suffix}") for op in ("dispatch", "combine"))
        for v, suffix in (("v1", ""), ("v2", "_v2"))
    }
    if requested == "auto":
        for version in ("v2", "v1"):
            if have[version]:
                return version
        raise BackendUnavailable("this torch_npu has neither npu_moe_distribute_dispatch(_v2) nor combine(_v2)")
    if requested not in VERSIONS:
        raise ConfigError(f"version={requested!r} must be 'auto' or one of {VERSIONS}")
    if not have[requested]:
        suffix = "_v2" if requested == "v2" else ""
        raise BackendUnavailable(f"this torch_npu lacks npu_moe_distribute_dispatch{suffix} or combine{suffix}")
    return requested


def product_of(soc_version: int) -> str:
    """ "A2" or "A3" for a ``torch_npu.npu.get_soc_version()`` code; ConfigError for another chip."""
    for product, codes in SOC_VERSIONS.items():
        if soc_version in codes:
            return product
    raise ConfigError(
        f"SoC version {soc_version} is neither Atlas A2 ({SOC_VERSIONS['A2'].start}-"
        f"{SOC_VERSIONS['A2'].stop - 1}) nor A3 ({SOC_VERSIONS['A3'].start}-{SOC_VERSIONS['A3'].stop - 1}):"
        f" MC2 is documented for those two; pass product= explicitly to override"
    )


def availability(group: Any) -> tuple[bool, str]:
    if importlib.util.find_spec("torch_npu") is None:
        return False, "mc2 strategy needs torch_npu (torch_npu is not installed)"
    try:
        import torch.distributed as dist

        backend = dist.get_backend(group)
    except Exception as exc:  # an uninitialised or foreign group
        return False, f"mc2 strategy needs an initialised hccl process group ({exc})"
    if backend != "hccl":
        return False, f"mc2 strategy needs an hccl process group, this group uses {backend!r}"
    return True, "torch_npu with an hccl group"


class Mc2Strategy(AllToAllStrategy):
    """Validated MC2 expanded dispatch/combine on ``group``; DeepEP-shaped ops over all_to_all on another group.

    Parameters
    ----------
    group : the hccl process group whose communicator the MC2 ops use (their EP domain); nothing else runs on it.
    timeout_s : bound of every wait of the all_to_all fallback.
    product : "A2", "A3" or "auto" (from ``torch_npu.npu.get_soc_version()``, see :func:`product_of`).
    version : "auto" (v2 where torch_npu has it, else v1), "v1" or "v2".
    comm_alg : v2's ``comm_alg`` ("" = the product's default, see :func:`resolve_comm_alg`).
    fallback_group : the hccl group of the all_to_all ops; None makes one over ``group``'s ranks
        (``new_group(..., use_local_synchronization=True)``: every rank of ``group`` creates its strategy).
    hccl_buffsize_mb : the EP group's buffer in MB where it was set per group (``hccl_buffer_size``); None reads
        ``HCCL_BUFFSIZE``.
    """

    name = "mc2"

    def __init__(
        self,
        group: Any,
        timeout_s: float,
        product: str = "auto",
        version: str = "auto",
        comm_alg: str = "",
        fallback_group: Any = None,
        hccl_buffsize_mb: int | None = None,
    ) -> None:
        import torch.distributed as dist
        import torch_npu

        if fallback_group is None:
            fallback_group = dist.new_group(
                dist.get_process_group_ranks(group),
                backend="hccl",
                use_local_synchronization=True,
                pg_options=hccl_pg_options(TrafficClass.MODEL),  # the EP all-to-all: the high traffic class
            )
        if fallback_group is group:
            raise ConfigError(
                "the all_to_all fallback needs its own process group: MC2's EP domain allows no other operator"
            )
        super().__init__(fallback_group, timeout_s)
        self.torch_npu = torch_npu
        self.product = product_of(torch_npu.npu.get_soc_version()) if product == "auto" else product
        self.version = op_version(torch_npu, version)
        resolve_comm_alg(self.version, self.product, comm_alg)  # a bad product or comm_alg fails at construction
        self.comm_alg = comm_alg
        self.mc2_group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # "npu" once torch_npu has renamed the PrivateUse1 backend (it does so on import)
        npu = torch.device(torch._C._get_privateuse1_backend_name())
        self.group_name = group._get_backend(npu).get_hccl_comm_name(self.rank)
        self.hccl_buffsize_mb = hccl_buffsize_mb

    def _checked_buffer(
        self,
        key: tuple[str, str, str],
        tokens: int,
        hidden: int,
        topk: int,
        moe_expert_num: int,
        kwargs: dict,
        itemsize: int,
    ) -> None:
        max_tokens = kwargs.get("global_bs", 0) // self.world or tokens
        need = required_hccl_buffsize_mb(
            *key,
            max_tokens=max_tokens,
            hidden=hidden,
            topk=topk,
            moe_expert_num=moe_expert_num,
            ep_world_size=self.world,
            shared_expert_rank_num=kwargs.get("shared_expert_rank_num", 0),
            shared_expert_num=kwargs.get("shared_expert_num", 1),
            x_itemsize=itemsize,
        )
        have = hccl_buffsize_mb() if self.hccl_buffsize_mb is None else self.hccl_buffsize_mb
        check_hccl_buffsize(need, have, "MC2 {} on {} with comm_alg {!r}".format(*key))

    def dispatch_expanded(self, x: torch.Tensor, expert_ids: torch.Tensor, moe_expert_num: int, **kwargs: Any):
        """``npu_moe_distribute_dispatch(_v2)`` after :func:`validate_dispatch` and the buffer check.

        Returns MC2's 7-tuple (``expand_x``, ``dynamic_scales``, ``expand_idx`` (v1) / ``assist_info_for_combine``
        (v2), ``expert_token_nums``, ``ep_recv_counts``, ``tp_recv_counts``, ``expand_scales``).
        """
        validate_dispatch(
            x,
            expert_ids,
            self.world,
            self.rank,
            moe_expert_num,
            product=self.product,
            version=self.version,
            comm_alg=self.comm_alg,
            quant_mode=kwargs.get("quant_mode", 0),
            x_active_mask=kwargs.get("x_active_mask"),
            global_bs=kwargs.get("global_bs", 0),
            expert_token_nums_type=kwargs.get("expert_token_nums_type", 1),
            shared_expert_rank_num=kwargs.get("shared_expert_rank_num", 0),
        )
        key = (self.version, self.product, resolve_comm_alg(self.version, self.product, self.comm_alg))
        self._checked_buffer(key, x.shape[0], x.shape[1], expert_ids.shape[1], moe_expert_num, kwargs, x.element_size())
        op = (
            self.torch_npu.npu_moe_distribute_dispatch_v2
            if self.version == "v2"
            else self.torch_npu.npu_moe_distribute_dispatch
        )
        options = {**kwargs, "comm_alg": self.comm_alg} if self.version == "v2" else dict(kwargs)
        return op(x, expert_ids, self.group_name, self.world, self.rank, moe_expert_num, **options)

    def combine_expanded(
        self,
        expand_x: torch.Tensor,
        expert_ids: torch.Tensor,
        assist_info: torch.Tensor,
        ep_send_counts: torch.Tensor,
        expert_scales: torch.Tensor,
        moe_expert_num: int,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``npu_moe_distribute_combine(_v2)`` (weighted sum) after :func:`validate_combine`.

        ``assist_info`` is dispatch's third output (``expand_idx`` for v1, ``assist_info_for_combine`` for v2).
        Returns bf16/fp16 ``[BS, H]``.
        """
        combine_alg = "" if self.comm_alg in ("fullmesh_v1", "fullmesh_v2") else self.comm_alg  # A3 combine_v2
        validate_combine(
            expand_x,
            expert_ids,
            expert_scales,
            self.world,
            self.rank,
            moe_expert_num,
            product=self.product,
            version=self.version,
            comm_alg=combine_alg,
            shared_expert_rank_num=kwargs.get("shared_expert_rank_num", 0),
        )
        op = (
            self.torch_npu.npu_moe_distribute_combine_v2
            if self.version == "v2"
            else self.torch_npu.npu_moe_distribute_combine
        )
        options = {**kwargs, "comm_alg": combine_alg} if self.version == "v2" else dict(kwargs)
        return op(
            expand_x,
            expert_ids,
            assist_info,
            ep_send_counts,
            expert_scales,
            self.group_name,
            self.world,
            self.rank,
            moe_expert_num,
            **options,
        )


def create(group: Any, timeout_s: float, **options: Any) -> Mc2Strategy:
    ok, reason = availability(group)
    if not ok:
        raise BackendUnavailable(reason)
    return Mc2Strategy(group, timeout_s, **options)
