"""The cluster file (``CLUSTER.toml``): an operator's nodes, links, model, parallelism and SLOs, validated.

Tables and keys (every key optional unless marked; defaults are the paper's Hopper testbed, §7.1)::

    [nodes]        prefill (required), decode (required), accelerators = 8 (per node)
    [hardware]     storage_nic_gbps = 400 (per node), compute_nic_gbps = 400 (per accelerator),
                   pcie_gbytes_per_s = 50 (per accelerator, H2D), dram_gbytes_per_s = 500 (per node),
                   dram_gb = 2048 (per node), hbm_gb = 80, hbm_tbytes_per_s = 3.35, peak_tflops = 989
                   (per accelerator, dense BF16), prefill_mfu = 0.55
    [model]        name (a built-in: ds660b, ds27b, qwen32b; required without layers), or its parameters /
                   overrides: layers, active_params_b (or flops_per_token), weight_gb, kv_bytes_per_token,
                   heads and head_dim (dense attention FLOPs) or attn_flops_per_pair, sparse_topk,
                   index_flops_per_pair, experts, top_k, routed_expert_fraction, ep_cnic_bytes_per_token,
                   decode_step_fixed_ms, decode_read_bytes_per_ctx_token, decode_read_bytes_per_attended
    [parallelism]  tp = 1 (accelerators per engine), prefill_ep, decode_ep (engines per EP instance; default:
                   the whole role when the weights do not fit one engine, else 1)
    [slo]          ttft_s = 4.0, tpot_s = 0.050
    [qos]          model_weight = 99, kv_weight = 1 (compute-NIC arbitration weights of the two traffic classes)
    [scheduler]    block_tokens = 64, tick_ms = 20, compute_quota_ms = 300, max_batch_tokens = 16384,
                   workspace_gb = 8 (HBM per accelerator)
    [transfer]     aiv_submit_us = 1.0, aiv_cores = 8, aicpu_issue_us = 1.5, aicpu_wqe_us = 0.2,
                   host_submit_us = 6.0, staging_chunk_bytes = 1048576, staging_copy_gbytes_per_s = 26

Errors are :class:`~ascend_dualpath.errors.ConfigError` (``CapacityError`` when the weights leave no HBM)
naming the file, the ``[table].key`` and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ascend_dualpath.dualpath.traffic import QosPolicy
from ascend_dualpath.errors import BackendUnavailable, ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig
from ascend_dualpath.sim.models import GB, MODELS, HardwareConfig, ModelConfig
from ascend_dualpath.sim.transfer import SubmissionCosts

EXAMPLES_DIR = Path(__file__).resolve().parent / "data" / "clusters"
GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Slo:
    """Per-request service objectives: time to first token and time per output token (seconds)."""

    ttft_s: float = 4.0
    tpot_s: float = 0.050


@dataclass(frozen=True)
class ClusterSpec:
    """What a cluster file describes: the simulator's config, the SLOs and the transfer-kind costs."""

    config: ClusterConfig
    slo: Slo
    costs: SubmissionCosts
    source: str


# key -> (check, scale into the simulator's unit): count = integer >= 1, positive = number > 0, nonneg = number >= 0
_NODES = {"prefill": ("count", 1), "decode": ("count", 1), "accelerators": ("count", 1)}
_HARDWARE = {
    "storage_nic_gbps": ("positive", GBPS),
    "compute_nic_gbps": ("positive", GBPS),
    "pcie_gbytes_per_s": ("positive", GB),
    "dram_gbytes_per_s": ("positive", GB),
    "dram_gb": ("positive", GB),
    "hbm_gb": ("positive", GB),
    "hbm_tbytes_per_s": ("positive", 1e12),
    "peak_tflops": ("positive", 1e12),
    "prefill_mfu": ("positive", 1),
}
_MODEL = {
    "layers": ("count", 1),
    "active_params_b": ("positive", 1e9),
    "flops_per_token": ("positive", 1),
    "weight_gb": ("positive", GB),
    "kv_bytes_per_token": ("count", 1),
    "heads": ("count", 1),
    "head_dim": ("count", 1),
    "attn_flops_per_pair": ("positive", 1),
    "sparse_topk": ("count", 1),
    "index_flops_per_pair": ("positive", 1),
    "experts": ("count", 1),
    "top_k": ("count", 1),
    "routed_expert_fraction": ("nonneg", 1),
    "ep_cnic_bytes_per_token": ("nonneg", 1),
    "decode_step_fixed_ms": ("positive", 1e-3),
    "decode_read_bytes_per_ctx_token": ("nonneg", 1),
    "decode_read_bytes_per_attended": ("positive", 1),
}
_PARALLELISM = {"tp": ("count", 1), "prefill_ep": ("count", 1), "decode_ep": ("count", 1)}
_SLO = {"ttft_s": ("positive", 1), "tpot_s": ("positive", 1)}
_QOS = {"model_weight": ("count", 1), "kv_weight": ("count", 1)}
_SCHEDULER = {
    "block_tokens": ("count", 1),
    "tick_ms": ("positive", 1e-3),
    "compute_quota_ms": ("positive", 1e-3),
    "max_batch_tokens": ("count", 1),
    "workspace_gb": ("nonneg", GB),
}
_TRANSFER = {
    "aiv_submit_us": ("nonneg", 1e-6),
    "aiv_cores": ("count", 1),
    "aicpu_issue_us": ("nonneg", 1e-6),
    "aicpu_wqe_us": ("nonneg", 1e-6),
    "host_submit_us": ("nonneg", 1e-6),
    "staging_chunk_bytes": ("count", 1),
    "staging_copy_gbytes_per_s": ("positive", GB),
}
_TABLES = {
    "nodes": _NODES,
    "hardware": _HARDWARE,
    "model": {**_MODEL, "name": None},
    "parallelism": _PARALLELISM,
    "slo": _SLO,
    "qos": _QOS,
    "scheduler": _SCHEDULER,
    "transfer": _TRANSFER,
}


_LIMITS = {"count": "an integer >= 1", "positive": "a number > 0", "nonneg": "a number >= 0"}


def _valid(value: object, check: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if check == "count":
        return isinstance(value, int) and value >= 1
    return value > 0 if check == "positive" else value >= 0


def _values(data: dict, table: str, where: str) -> dict[str, float]:
    """The table's numeric keys checked against their limits and scaled to the simulator's units."""
    section = data.get(table, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: [{table}] must be a table, got {section!r}")
    known = _TABLES[table]
    values = {}
    for key, value in section.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key [{table}].{key}; known: {sorted(known)}")
        if known[key] is None:
            continue
        check, scale = known[key]
        if not _valid(value, check):
            raise ConfigError(f"{where}: [{table}].{key} must be {_LIMITS[check]}, got {value!r}")
        values[key] = value * scale
    return values


# cluster-file key -> the simulator's field, per table (counts are ints already: validated and unscaled)
_MODEL_FIELDS = {
    "layers": "layers",
    "weight_gb": "weight_bytes",
    "kv_bytes_per_token": "kv_bytes_per_token",
    "attn_flops_per_pair": "attn_flops_per_pair",
    "sparse_topk": "sparse_topk",
    "index_flops_per_pair": "index_flops_per_pair",
    "routed_expert_fraction": "routed_expert_fraction",
    "ep_cnic_bytes_per_token": "ep_cnic_bytes_per_token",
    "decode_step_fixed_ms": "decode_step_fixed_s",
    "decode_read_bytes_per_ctx_token": "decode_read_bytes_per_ctx_token",
    "decode_read_bytes_per_attended": "decode_read_bytes_per_attended",
}
_HARDWARE_FIELDS = {
    "storage_nic_gbps": "snic_bytes_per_s",
    "compute_nic_gbps": "cnic_bytes_per_s",
    "pcie_gbytes_per_s": "pcie_bytes_per_s",
    "dram_gbytes_per_s": "dram_bytes_per_s",
    "dram_gb": "dram_bytes",
    "hbm_gb": "hbm_bytes",
    "hbm_tbytes_per_s": "hbm_bytes_per_s",
    "peak_tflops": "peak_flops",
    "prefill_mfu": "prefill_mfu",
}
_SCHEDULER_FIELDS = {
    "tick_ms": "tick_s",
    "compute_quota_ms": "compute_quota_s",
    "workspace_gb": "workspace_bytes",
    "block_tokens": "block_tokens",
    "max_batch_tokens": "max_batch_tokens",
}
_TRANSFER_FIELDS = {
    "aiv_submit_us": "aiv_submit_s",
    "aiv_cores": "aiv_cores",
    "aicpu_issue_us": "aicpu_issue_s",
    "aicpu_wqe_us": "aicpu_wqe_s",
    "host_submit_us": "host_submit_s",
    "staging_chunk_bytes": "staging_chunk_bytes",
    "staging_copy_gbytes_per_s": "staging_copy_bytes_per_s",
}


def _renamed(values: dict[str, float], fields: dict[str, str]) -> dict[str, float]:
    """The ``values`` that ``fields`` maps, under the simulator's field names."""
    return {field: values[key] for key, field in fields.items() if key in values}


def _custom_model_missing(values: dict[str, float]) -> list[str]:
    """The parameters a model that is not built in lacks (empty when it has them all)."""
    missing = [key for key in ("weight_gb", "kv_bytes_per_token") if key not in values]
    if "active_params_b" not in values and "flops_per_token" not in values:
        missing.append("active_params_b or flops_per_token")
    if "attn_flops_per_pair" not in values and "heads" not in values:
        missing.append("heads (or attn_flops_per_pair)")
    return missing


def _base_model(name: str | None, values: dict[str, float], where: str) -> ModelConfig | None:
    """The built-in model ``name`` names, or None for a model given by its parameters (checked complete)."""
    if name in MODELS:
        return MODELS[name]
    if "layers" in values:
        missing = _custom_model_missing(values)
        if missing:
            raise ConfigError(f"{where}: [model] {name or 'custom'} needs {', '.join(missing)}")
        return None
    if name is None:
        raise ConfigError(f"{where}: [model].name is required (one of {sorted(MODELS)}), or the model's parameters")
    raise ConfigError(
        f"{where}: [model].name {name!r} is not built in ({sorted(MODELS)}); give its "
        "parameters (layers, active_params_b, weight_gb, kv_bytes_per_token, heads) instead"
    )


def _model_fields(values: dict[str, float], base: ModelConfig | None) -> dict:
    """:class:`ModelConfig` fields from the [model] values (attention FLOPs derived from ``heads``)."""
    fields: dict = {}
    layers = int(values.get("layers", base.layers if base else 1))
    if "heads" in values:
        head_dim = values.get("head_dim", 128)
        fields["attn_flops_per_pair"] = 4 * values["heads"] * head_dim * layers  # QK^T + AV, 2 FLOPs per MAC
    fields.update(_renamed(values, _MODEL_FIELDS))
    if "active_params_b" in values:
        fields["active_params"] = values["active_params_b"]
    elif "flops_per_token" in values:
        fields["active_params"] = values["flops_per_token"] / 2  # GEMM FLOPs per token = 2 x activated params
    return fields


def _model(data: dict, where: str) -> ModelConfig:
    section = data.get("model", {})
    values = _values(data, "model", where)
    name = section.get("name") if isinstance(section, dict) else None
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"{where}: [model].name must be a string, got {name!r}")
    base = _base_model(name, values, where)
    if "top_k" in values and "experts" in values and values["top_k"] > values["experts"]:
        raise ConfigError(f"{where}: [model].top_k={values['top_k']} exceeds experts={values['experts']}")
    fields = _model_fields(values, base)
    if base is not None:
        return replace(base, **fields)
    fields.setdefault("decode_read_bytes_per_attended", fields["kv_bytes_per_token"])
    return ModelConfig(name=name or "custom", **fields)


def _nodes(data: dict, where: str) -> dict[str, float]:
    """The [nodes] values, prefill and decode required."""
    nodes = _values(data, "nodes", where)
    for key in ("prefill", "decode"):
        if key not in nodes:
            raise ConfigError(f"{where}: [nodes].{key} is required (an integer >= 1)")
    return nodes


def _hardware(data: dict, nodes: dict[str, float], where: str) -> HardwareConfig:
    """The per-accelerator and per-node hardware of [hardware] (accelerators per node from [nodes])."""
    hw = _values(data, "hardware", where)
    hardware = HardwareConfig(gpus_per_node=int(nodes.get("accelerators", 8)), **_renamed(hw, _HARDWARE_FIELDS))
    if hardware.prefill_mfu > 1:
        raise ConfigError(f"{where}: [hardware].prefill_mfu must be <= 1, got {hardware.prefill_mfu}")
    return hardware


def _qos(data: dict, where: str) -> QosPolicy:
    """The traffic classes' arbitration weights of [qos] (the library's :class:`QosPolicy` defaults, 99:1)."""
    weights = {key: int(value) for key, value in _values(data, "qos", where).items()}
    policy = QosPolicy()
    return QosPolicy(
        model=replace(policy.model, weight=weights.get("model_weight", policy.model.weight)),
        kv=replace(policy.kv, weight=weights.get("kv_weight", policy.kv.weight)),
    )


def parse_cluster(data: dict, where: str = "cluster") -> ClusterSpec:
    """A :class:`ClusterSpec` from a decoded cluster file; ``where`` prefixes every error."""
    for table in data:
        if table not in _TABLES:
            raise ConfigError(f"{where}: unknown table [{table}]; known: {sorted(_TABLES)}")
    nodes = _nodes(data, where)
    hardware = _hardware(data, nodes, where)
    parallel = {key: int(value) for key, value in _values(data, "parallelism", where).items()}
    knobs = _renamed(_values(data, "scheduler", where), _SCHEDULER_FIELDS)
    model = _model(data, where)
    try:
        config = ClusterConfig(
            model, hardware, int(nodes["prefill"]), int(nodes["decode"]), **knobs, **parallel, qos=_qos(data, where)
        )
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    slo = Slo(**_values(data, "slo", where))
    costs = SubmissionCosts(**_renamed(_values(data, "transfer", where), _TRANSFER_FIELDS))
    return ClusterSpec(config, slo, costs, where)


def load_cluster(path: Path | str) -> ClusterSpec:
    """Read and validate a ``CLUSTER.toml``; a bare name (``ds660b_2p4d``) picks a shipped example."""
    path = Path(path)
    if not path.is_file() and (EXAMPLES_DIR / f"{path.name}.toml").is_file():
        path = EXAMPLES_DIR / f"{path.name}.toml"
    if not path.is_file():
        raise ConfigError(f"cluster file {path} not found (shipped examples: {example_names()})")
    try:
        import tomllib
    except ModuleNotFoundError:
        raise BackendUnavailable("reading a cluster file needs Python >= 3.11 (tomllib)") from None
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not TOML ({error})") from None
    return parse_cluster(data, str(path))


def example_names() -> list[str]:
    """The shipped example cluster files, by name."""
    return sorted(path.stem for path in EXAMPLES_DIR.glob("*.toml"))
