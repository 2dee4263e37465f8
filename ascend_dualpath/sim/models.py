"""Hardware and model configurations of the simulator, with where each figure comes from.

Hardware defaults are the paper's testbed (§7.1): Hopper nodes with 8 GPUs, one 400 Gbps CNIC per GPU,
one 400 Gbps storage NIC per node (3FS saturates it), 80 GB HBM per GPU. Compute efficiency is an
explicit assumption (``prefill_mfu``), documented in docs/simulator.md.

Model figures: FLOPs per token = 2 x activated parameters (GEMMs) + attention. KV bytes per token are
chosen to match the paper's cache-compute ratios (Table 1, GB/PFLOP at append 429): the check is
:func:`cache_compute_ratio`, tested against Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ascend_dualpath.dualpath.scheduler import EngineProfile
from ascend_dualpath.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class HardwareConfig:
    """One node type (all nodes equal). Per accelerator: its CNIC, PCIe link (H2D copies), HBM, compute;
    per node: the storage NIC and DRAM."""

    gpus_per_node: int = 8
    cnic_bytes_per_s: float = 50 * GB  # 400 Gbps per GPU-paired compute NIC
    snic_bytes_per_s: float = 50 * GB  # one 400 Gbps storage NIC per node
    dram_bytes_per_s: float = 500 * GB  # host memory (paper's M)
    dram_bytes: float = 2048 * GB  # host memory per node (only a single request's KV is checked against it)
    # H2D (DRAM buffer -> HBM): PCIe Gen5 x16 is 64 GB/s raw per direction, shared with the paired CNIC under
    # one switch (§4.2), so the paper's model and ours copy at B
    pcie_bytes_per_s: float = 50 * GB
    hbm_bytes: float = 80 * GB  # H800/H100 80 GB
    hbm_bytes_per_s: float = 3.35e12
    peak_flops: float = 989e12  # dense BF16 peak; FP8 GEMMs run at up to 2x this
    prefill_mfu: float = 0.55  # assumption: achieved fraction of BF16 peak in prefill (FP8 GEMMs ~ 28% of FP8 peak)

    @property
    def prefill_flops_per_s(self) -> float:
        return self.peak_flops * self.prefill_mfu


@dataclass(frozen=True)
class ModelConfig:
    """What the simulator needs of a model.

    ``attn_flops_per_pair``: FLOPs per (query token, attended key) pair, QK^T and AV together;
    ``index_flops_per_pair``: FLOPs per (query, context key) of a sparse-attention indexer (0 if none);
    ``sparse_topk``: keys each query attends to under sparse attention (None = dense);
    ``kv_bytes_per_token``: the KV cache stored, read and transferred per token (all layers);
    ``decode_read_bytes_per_ctx_token`` / ``decode_read_bytes_per_attended``: HBM bytes a decode step
    reads per context token (indexer keys) and per attended token;
    ``decode_step_fixed_s``: decode step time independent of batch (weights, EP all-to-all latency);
    ``routed_expert_fraction``: the share of ``active_params`` in routed MoE experts, whose GEMMs expert
    parallelism spreads over the EP ranks (0 for a dense model);
    ``ep_cnic_bytes_per_token``: bytes per prefill token, dispatch and combine together over all MoE layers,
    that the EP all-to-all sends over the compute NICs when an instance spans nodes (model traffic; 0 for a
    dense model, whose TP collectives stay on the node's scale-up links).
    """

    name: str
    layers: int
    active_params: float
    weight_bytes: float
    kv_bytes_per_token: int
    attn_flops_per_pair: float
    index_flops_per_pair: float = 0.0
    sparse_topk: int | None = None
    decode_read_bytes_per_ctx_token: float = 0.0
    decode_read_bytes_per_attended: float = 0.0
    decode_step_fixed_s: float = 0.020
    routed_expert_fraction: float = 0.0
    ep_cnic_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layers", "active_params", "weight_bytes", "kv_bytes_per_token"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model {self.name!r}: {name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.routed_expert_fraction < 1.0:
            raise ConfigError(
                f"model {self.name!r}: routed_expert_fraction must be in [0, 1), got {self.routed_expert_fraction}"
            )

    def gemm_flops(self, tokens: int) -> float:
        return 2.0 * self.active_params * tokens

    def dense_gemm_flops(self, tokens: int) -> float:
        """GEMM FLOPs a rank spends on its own tokens: everything but the routed experts."""
        return 2.0 * self.active_params * (1.0 - self.routed_expert_fraction) * tokens

    def routed_gemm_flops(self, tokens: int) -> float:
        """GEMM FLOPs of the routed experts for ``tokens`` tokens, wherever expert parallelism runs them."""
        return 2.0 * self.active_params * self.routed_expert_fraction * tokens

    def attention_flops(self, cached: int, bsz: int) -> float:
        return self.profile_template().attention_flops(cached, bsz)

    def profile_template(self, seconds_per_flop: float = 1.0) -> EngineProfile:
        return EngineProfile(
            read_tokens_per_s=1.0,
            prefill_tokens_per_s=1.0,
            attn_flops_per_pair=self.attn_flops_per_pair,
            seconds_per_flop=seconds_per_flop,
            index_flops_per_pair=self.index_flops_per_pair,
            sparse_topk=self.sparse_topk,
        )


# DeepSeek-V3.2 (660B, 37B activated, 61 layers, MLA + DSA). Per layer the cache keeps the 512-dim
# latent in FP8 with 4 FP32 scales plus the 64-dim RoPE key in BF16: 512 + 16 + 128 = 656 B; x 61.
# Absorbed MLA attention: 128 heads x (576 QK + 512 AV) x 2 FLOPs per pair per layer; DSA top-k 2048.
# Indexer: 64 heads x 128 dim x 2 FLOPs per pair per layer (FP8), 128 + 4 B of keys per token per layer.
DS_660B = ModelConfig(
    name="ds660b",
    layers=61,
    active_params=37e9,
    weight_bytes=690e9,
    kv_bytes_per_token=656 * 61,
    attn_flops_per_pair=128 * (576 + 512) * 2 * 61,
    index_flops_per_pair=64 * 128 * 2 * 61,
    sparse_topk=2048,
    decode_read_bytes_per_ctx_token=132 * 61,
    decode_read_bytes_per_attended=656 * 61,
    decode_step_fixed_s=0.025,
    # routed experts: 8 of 256 per token x 58 MoE layers x 3 x 7168 x 2048 = 20.4B of the 37B activated
    routed_expert_fraction=0.55,
    # EP all-to-all across nodes: per token and MoE layer the hidden state goes out FP8 (7168 B, dispatch) and
    # comes back BF16 (14336 B, combine), one copy per remote node (DeepEP-style node dedup; EP16 on 2 nodes
    # has one remote node, and 8 of 256 experts almost always include one there): 58 x 7168 x 3 B
    ep_cnic_bytes_per_token=58 * 7168 * 3,
)

# The paper's internal DS 27B (§A.2: hidden 2560, 30 layers, 72 routed experts top-6 + 2 shared, DSA
# indexer top-k 1024). Activated parameters and MLA head count are not published: assumed 3.5B active,
# 32 heads, the same 656 B/layer latent cache.
DS_27B = ModelConfig(
    name="ds27b",
    layers=30,
    active_params=3.5e9,
    weight_bytes=27e9,
    kv_bytes_per_token=656 * 30,
    attn_flops_per_pair=32 * (576 + 512) * 2 * 30,
    index_flops_per_pair=64 * 128 * 2 * 30,
    sparse_topk=1024,
    decode_read_bytes_per_ctx_token=132 * 30,
    decode_read_bytes_per_attended=656 * 30,
    decode_step_fixed_s=0.012,
    # assumed: FFN ~ 2/3 of the activated parameters, 6 of its 8 active experts routed (2 shared)
    routed_expert_fraction=0.5,
    # as DS-660B with hidden 2560, assuming every one of the 30 layers is MoE (only used when ep spans nodes)
    ep_cnic_bytes_per_token=30 * 2560 * 3,
)

# Qwen2.5-32B: 64 layers, 40 query heads, GQA with 8 KV heads of dim 128, FP16 KV (Table 1 footnote):
# 2 x 8 x 128 x 2 B x 64 layers = 262,144 B/token; attention 40 heads x 128 x 2 (QK+AV) x 2 FLOPs.
QWEN_32B = ModelConfig(
    name="qwen32b",
    layers=64,
    active_params=32.5e9,
    weight_bytes=65e9,
    kv_bytes_per_token=2 * 8 * 128 * 2 * 64,
    attn_flops_per_pair=40 * 128 * 2 * 2 * 64,
    decode_read_bytes_per_attended=2 * 8 * 128 * 2 * 64,
    decode_step_fixed_s=0.015,
)

MODELS = {model.name: model for model in (DS_660B, DS_27B, QWEN_32B)}


def get_model(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None


def cache_compute_ratio(model: ModelConfig, context: int, append: int = 429) -> float:
    """GB of hit KV per PFLOP of prefill compute for one round (paper Table 1's metric)."""
    flops = model.gemm_flops(append) + model.attention_flops(context, append)
    return context * model.kv_bytes_per_token / GB / (flops / 1e15)


def engine_profile(
    model: ModelConfig, hardware: HardwareConfig, profiled_context: int = 32768, profiled_append: int = 512
) -> EngineProfile:
    """The profile the scheduler's alpha, beta and compute quota are derived from (§A.4)."""
    seconds_per_flop = 1.0 / hardware.prefill_flops_per_s
    round_flops = model.gemm_flops(profiled_append) + model.attention_flops(profiled_context, profiled_append)
    return EngineProfile(
        read_tokens_per_s=hardware.snic_bytes_per_s / model.kv_bytes_per_token,
        # tok_e counts whole prompts (hit + new), so "tokens processed" is measured the same way
        prefill_tokens_per_s=(profiled_context + profiled_append) / (round_flops * seconds_per_flop),
        attn_flops_per_pair=model.attn_flops_per_pair,
        seconds_per_flop=seconds_per_flop,
        index_flops_per_pair=model.index_flops_per_pair,
        sparse_topk=model.sparse_topk,
    )
