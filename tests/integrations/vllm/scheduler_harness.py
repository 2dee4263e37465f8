"""vLLM's real ``Scheduler`` driven without a model: configs, requests and fabricated model-runner outputs.

Built only on vLLM's public constructors (vLLM's own test helpers are not in the wheel). One model directory
holds a tiny Llama ``config.json`` (no weights or tokenizer are read: ``skip_tokenizer_init``); a ``VllmConfig``
carries the KV connector under test; each test builds a fresh ``Scheduler`` on one full-attention KV cache
group and steps it with ``step``: ``schedule()``, then ``update_from_output()`` with a ``ModelRunnerOutput``
that samples one token per request whose prefill completes and reports whatever ``KVConnectorOutput`` the test
gives (finished sending / receiving, invalid block ids, failed receives).

``ScriptedConnector`` is a minimal scheduler-side connector that answers from ``kv_transfer_params["scripted"]``
(``{"hit": tokens, "async": bool}``) and records every call, to prove the harness itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32
NUM_BLOCKS = 64  # usable blocks are 1..63: vLLM keeps block 0 as its null block
MAX_MODEL_LEN = 1024
# The tiny Llama's attention geometry; layer names are the ones vLLM gives a LlamaForCausalLM.
NUM_LAYERS, KV_HEADS, HEAD_SIZE = 2, 1, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SAMPLED_TOKEN = 7


def write_tiny_model_config(directory: Path) -> Path:
    """A ``config.json`` of a 2-layer Llama (head size 64, 1 KV head) in ``directory``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_SIZE,
        num_hidden_layers=NUM_LAYERS,
        vocab_size=512,
        max_position_embeddings=MAX_MODEL_LEN,
        torch_dtype="bfloat16",
        rms_norm_eps=1e-5,
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def make_vllm_config(model_dir: Path, kv_transfer_config: KVTransferConfig | None) -> VllmConfig:
    """Engine config of the tiny model with ``block_size=32`` and the given connector (None: no connector)."""
    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS  # set by the engine after profiling; the scheduler asserts it
    scheduler = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False
    )
    return VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=scheduler, kv_transfer_config=kv_transfer_config
    )


def make_scheduler(vllm_config: VllmConfig) -> Scheduler:
    """A fresh ``Scheduler`` (and its SCHEDULER-role connector) over one full-attention KV cache group."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)]
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


def make_request(
    vllm_config: VllmConfig,
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    kv_transfer_params: dict | None = None,
) -> Request:
    """A greedy request with vLLM's block hasher (the engine core installs one whenever a connector is set)."""
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    return Request(request_id, prompt, params, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn))


def model_output(scheduler: Scheduler, scheduler_output, kv_connector_output=None) -> ModelRunnerOutput:
    """What a model runner returns for ``scheduler_output``: one token for each request whose prompt is done
    (``schedule()`` has already advanced ``num_computed_tokens`` by the scheduled tokens)."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [
        [SAMPLED_TOKEN] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens else []
        for r in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def step(scheduler: Scheduler, **kv_output: Any):
    """One engine step; ``kv_output`` fills the ``KVConnectorOutput`` (omitted: none). Returns (scheduled, outputs)."""
    scheduled = scheduler.schedule()
    kv = KVConnectorOutput(**kv_output) if kv_output else None
    return scheduled, scheduler.update_from_output(scheduled, model_output(scheduler, scheduled, kv))


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    loads: dict[str, list[int]] = field(default_factory=dict)


class ScriptedConnector(KVConnectorBase_V1):
    """Scheduler half that answers ``get_num_new_matched_tokens`` from the request's ``kv_transfer_params``."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.calls: list[tuple] = []
        self.pending: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        script = (request.kv_transfer_params or {}).get("scripted", {})
        self.calls.append(("match", request.request_id, num_computed_tokens))
        hit = max(0, script.get("hit", 0) - num_computed_tokens)
        return hit, bool(script.get("async")) and hit > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens, blocks.get_block_ids()))
        if num_external_tokens:
            self.pending[request.request_id] = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output):
        meta, self.pending = ScriptedMetadata(loads=self.pending), {}
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, request.status))
        return False, None

    # Worker half: unused here (no model runs).
    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None
