"""``mc2``: torch_npu's fused MoE dispatch/combine ops (``npu_moe_distribute_dispatch(_v2)`` / ``combine(_v2)``).

MC2's output is *expanded* (one row per (token, expert), grouped by local expert) with opaque combine metadata
(``expand_idx`` / ``assist_info_for_combine``), so it cannot fill DeepEP's packed ``[L, R·M, H]`` layout with
source indices. This strategy therefore offers the MC2 ops as :meth:`Mc2Strategy.dispatch_expanded` /
:meth:`Mc2Strategy.combine_expanded` (weighted combine, MC2's semantics), and runs the DeepEP-shaped ops of
:class:`~ascend_dualpath.moe.Buffer` over ``all_to_all_single`` on the same HCCL group. Every documented MC2
constraint is checked by :func:`validate_dispatch` / :func:`validate_combine` before the op is called.

Constraints (op-plugin docs for ``torch_npu.npu_moe_distribute_*``; A2 = Atlas A2, A3 = Atlas A3):

======================  ==================  ==================  ==============
limit                   v1 A2               v1 A3               v2
======================  ==================  ==================  ==============
tokens per rank (BS)    <= 256              <= 512              <= 512 (A3), <= 256 (A2)
top-k (K)               <= 16               <= 8                <= 16
experts (E)             <= 512              <= 512              <= 1024
local experts           <= 24               --                  <= 24 on A2
hidden (H)              --                  == 7168             dispatch [1024, 8192], combine [1024, 7168]
expert ids              [0, E), no -1, no duplicate in a row; v2 masks slots with ``x_active_mask``
quant_mode              0 (none) or 2 (dynamic per-token INT8)
======================  ==================  ==================  ==============
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ascend_dualpath.errors import BackendUnavailable, BoundsError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy

PRODUCTS = ("A2", "A3")
VERSIONS = ("v1", "v2")
QUANT_MODES = (0, 2)
MAX_TOKENS = {"A2": 256, "A3": 512}
MAX_TOPK = {("A2", "v1"): 16, ("A3", "v1"): 8, ("A2", "v2"): 16, ("A3", "v2"): 16}
MAX_EXPERTS = {"v1": 512, "v2": 1024}
A2_MAX_LOCAL_EXPERTS = 24
A3_V1_HIDDEN = 7168
V2_DISPATCH_HIDDEN = (1024, 8192)
V2_COMBINE_HIDDEN = (1024, 7168)


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


def _check_common(tokens: int, hidden: int, topk: int, num_experts: int, ep_world_size: int, ep_rank_id: int,
                  product: str, version: str, hidden_range: tuple[int, int] | None) -> None:
    if product not in PRODUCTS:
        raise ConfigError(f"product={product!r} must be one of {PRODUCTS}")
    if version not in VERSIONS:
        raise ConfigError(f"version={version!r} must be one of {VERSIONS}")
    if ep_world_size < 1 or not 0 <= ep_rank_id < ep_world_size:
        raise ConfigError(f"ep_rank_id={ep_rank_id} must be in [0, ep_world_size={ep_world_size})")
    if tokens > MAX_TOKENS[product]:
        raise PayloadTooLarge(f"MC2 on {product} takes at most {MAX_TOKENS[product]} tokens per rank, got {tokens}")
    if topk > MAX_TOPK[(product, version)]:
        raise ConfigError(f"MC2 {version} on {product} takes top-k <= {MAX_TOPK[(product, version)]}, got {topk}")
    if num_experts > MAX_EXPERTS[version] or num_experts % ep_world_size:
        raise ConfigError(f"moe_expert_num={num_experts} must be <= {MAX_EXPERTS[version]} ({version}) and a "
                          f"multiple of ep_world_size={ep_world_size}")
    if product == "A2" and num_experts // ep_world_size > A2_MAX_LOCAL_EXPERTS:
        raise ConfigError(f"MC2 on A2 takes <= {A2_MAX_LOCAL_EXPERTS} local experts, got "
                          f"{num_experts // ep_world_size}")
    if version == "v1" and product == "A3" and hidden != A3_V1_HIDDEN:
        raise ConfigError(f"MC2 v1 on A3 needs hidden == {A3_V1_HIDDEN}, got {hidden}")
    if version == "v2" and hidden_range is not None and not hidden_range[0] <= hidden <= hidden_range[1]:
        raise ConfigError(f"MC2 v2 needs hidden in [{hidden_range[0]}, {hidden_range[1]}], got {hidden}")


def validate_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, ep_world_size: int, ep_rank_id: int,
                      moe_expert_num: int, *, quant_mode: int = 0, product: str = "A3", version: str = "v2",
                      x_active_mask: torch.Tensor | None = None, global_bs: int = 0,
                      expert_token_nums_type: int = 1) -> None:
    """Check the documented MC2 dispatch constraints; raise a specific error naming value and limit.

    Parameters
    ----------
    x : bf16/fp16 [BS, H]; expert_ids : int32 [BS, K]
    x_active_mask : v2 only; bool [BS] (true prefix of active tokens) or [BS, K] (active slots)
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"MC2 x must be bf16/fp16 [BS, H], got {x.dtype} {list(x.shape)}")
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ConfigError(f"MC2 expert_ids must be int32 [BS={x.shape[0]}, K], got {expert_ids.dtype} "
                          f"{list(expert_ids.shape)}")
    tokens, hidden = x.shape
    _check_common(tokens, hidden, expert_ids.shape[1], moe_expert_num, ep_world_size, ep_rank_id, product, version,
                  V2_DISPATCH_HIDDEN)
    if quant_mode not in QUANT_MODES:
        raise ConfigError(f"quant_mode={quant_mode} must be one of {QUANT_MODES} (0 none, 2 dynamic INT8)")
    if expert_token_nums_type not in (0, 1):
        raise ConfigError(f"expert_token_nums_type={expert_token_nums_type} must be 0 (prefix sums) or 1 (counts)")
    if global_bs and tokens > global_bs // ep_world_size:
        raise PayloadTooLarge(f"{tokens} tokens exceed global_bs / ep_world_size = {global_bs // ep_world_size}")
    active = torch.ones_like(expert_ids, dtype=torch.bool)
    if x_active_mask is not None:
        if version != "v2":
            raise ConfigError("x_active_mask needs the v2 ops")
        if x_active_mask.dtype != torch.bool or tuple(x_active_mask.shape) not in ((tokens,), tuple(expert_ids.shape)):
            raise ConfigError(f"x_active_mask must be bool [BS] or [BS, K], got {x_active_mask.dtype} "
                              f"{list(x_active_mask.shape)}")
        if x_active_mask.dim() == 1:
            if bool((x_active_mask[1:] & ~x_active_mask[:-1]).any()):
                raise ConfigError("a 1-D x_active_mask must be a prefix of True values")
            active = x_active_mask.unsqueeze(1).expand_as(expert_ids)
        else:
            active = x_active_mask
    ids = expert_ids.long()
    bad = active & ((ids < 0) | (ids >= moe_expert_num))
    if bool(bad.any()):
        value = int(ids[bad][0])
        raise BoundsError(f"MC2 expert id {value} is outside [0, moe_expert_num={moe_expert_num}) "
                          f"(-1 is allowed only in slots masked off by x_active_mask)")
    masked = torch.where(active, ids, -1 - torch.arange(ids.shape[1]).expand_as(ids))  # unique fillers
    sorted_ids = masked.sort(dim=1).values
    if bool((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any()):
        raise ConfigError("MC2 expert_ids must not repeat an expert within a token's row")


def validate_combine(expand_x: torch.Tensor, expert_ids: torch.Tensor, expert_scales: torch.Tensor,
                     ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *, product: str = "A3",
                     version: str = "v2") -> None:
    """Check the documented MC2 combine constraints (shapes, dtypes, hidden range, scale shape)."""
    if expand_x.dim() != 2 or expand_x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"MC2 expand_x must be bf16/fp16 [A, H], got {expand_x.dtype} {list(expand_x.shape)}")
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 2:
        raise ConfigError(f"MC2 expert_ids must be int32 [BS, K], got {expert_ids.dtype} {list(expert_ids.shape)}")
    if expert_scales.dtype != torch.float32 or tuple(expert_scales.shape) != tuple(expert_ids.shape):
        raise ConfigError(f"MC2 expert_scales must be float32 {list(expert_ids.shape)}, got {expert_scales.dtype} "
                          f"{list(expert_scales.shape)}")
    _check_common(expert_ids.shape[0], expand_x.shape[1], expert_ids.shape[1], moe_expert_num, ep_world_size,
                  ep_rank_id, product, version, V2_COMBINE_HIDDEN)


class Mc2Strategy(AllToAllStrategy):
    """DeepEP-shaped ops over all_to_all on the HCCL group, plus validated MC2 expanded dispatch/combine."""

    name = "mc2"

    def __init__(self, group: Any, timeout_s: float, product: str = "A3") -> None:
        super().__init__(group, timeout_s)
        import torch.distributed as dist
        import torch_npu

        self.torch_npu = torch_npu
        self.product = product
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.group_name = group._get_backend(torch.device("npu")).get_hccl_comm_name(self.rank)

    def dispatch_expanded(self, x: torch.Tensor, expert_ids: torch.Tensor, moe_expert_num: int, **kwargs: Any):
        """``npu_moe_distribute_dispatch_v2`` after :func:`validate_dispatch`; returns MC2's 7-tuple."""
        validate_dispatch(x, expert_ids, self.world, self.rank, moe_expert_num, product=self.product,
                          quant_mode=kwargs.get("quant_mode", 0), x_active_mask=kwargs.get("x_active_mask"),
                          global_bs=kwargs.get("global_bs", 0),
                          expert_token_nums_type=kwargs.get("expert_token_nums_type", 1))
        return self.torch_npu.npu_moe_distribute_dispatch_v2(
            x, expert_ids, self.group_name, self.world, self.rank, moe_expert_num, **kwargs)

    def combine_expanded(self, expand_x: torch.Tensor, expert_ids: torch.Tensor, assist_info: torch.Tensor,
                         ep_send_counts: torch.Tensor, expert_scales: torch.Tensor, moe_expert_num: int,
                         **kwargs: Any) -> torch.Tensor:
        """``npu_moe_distribute_combine_v2`` (weighted sum) after :func:`validate_combine`."""
        validate_combine(expand_x, expert_ids, expert_scales, self.world, self.rank, moe_expert_num,
                         product=self.product)
        return self.torch_npu.npu_moe_distribute_combine_v2(
            expand_x, expert_ids, assist_info, ep_send_counts, expert_scales, self.group_name, self.world,
            self.rank, moe_expert_num, **kwargs)


def create(group: Any, timeout_s: float, **options: Any) -> Mc2Strategy:
    ok, reason = availability(group)
    if not ok:
        raise BackendUnavailable(reason)
    return Mc2Strategy(group, timeout_s, **options)
