"""A tiny Llama-style decoder for demos and tests: weights from a seed, no download.

RMSNorm, rotary position embeddings (rotate-half), grouped-query attention and a SwiGLU MLP, in float32,
bfloat16 or float64. The forward pass is exposed layer by layer in the shape DualPath's prefill needs:
layer ``l`` consumes the *hit* KV of the cached prefix (``[T_hit, 2, kv_heads, head_dim]``, the token
rows of a GQA Layer Block) and produces the *miss* KV of the new tokens, so that a prefix-cached prefill
can be checked against a full recompute. Keys are cached after RoPE, as serving engines do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ascend_dualpath.errors import BoundsError, ConfigError
from ascend_dualpath.kv.layout import DEFAULT_BLOCK_TOKENS, KVLayout

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 352
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def kv_layout(self, dtype: torch.dtype, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVLayout:
        """The GQA block layout of this model's KV cache in ``dtype``."""
        return KVLayout.gqa(self.num_layers, self.num_kv_heads, self.head_dim, dtype, block_tokens)


class TinyLlama:
    """The model: a dict of weight tensors and the forward pass over them (no autograd, no nn.Module state).

    Parameters
    ----------
    config : TinyLlamaConfig
        Sizes and the weight seed.
    dtype : torch.dtype
        Compute and KV dtype: float32, bfloat16 or float64. Weights are drawn in float32 from ``config.seed`` and
        rounded to ``dtype``.
    """

    def __init__(self, config: TinyLlamaConfig = TinyLlamaConfig(), dtype: torch.dtype = torch.float32) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.weights = {name: tensor.to(dtype) for name, tensor in _seeded_weights(config).items()}

    def with_dtype(self, dtype: torch.dtype) -> TinyLlama:
        """The same weights as this model's (already rounded to its dtype), computed in ``dtype``.

        ``bf16_model.with_dtype(torch.float64)`` is the float64 reference of the bf16 model: identical weight
        values, exact arithmetic (to float64).
        """
        twin = TinyLlama.__new__(TinyLlama)
        twin.config, twin.dtype = self.config, dtype
        twin.weights = {name: tensor.to(dtype) for name, tensor in self.weights.items()}
        return twin

    # -- pieces -----------------------------------------------------------------------------------------------------
    def _rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        work = hidden.float() if hidden.dtype == torch.bfloat16 else hidden
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return normed.to(self.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE: ``x [T, heads, head_dim]`` at ``positions [T]``."""
        half = self.config.head_dim // 2
        angle_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        inv_freq = self.config.rope_theta ** (-torch.arange(half, dtype=angle_dtype) / half)
        angles = positions.to(angle_dtype)[:, None] * inv_freq[None, :]  # [T, half]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].to(self.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].to(self.dtype)
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``int [T] -> dtype [T, hidden]``."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise BoundsError(
                f"token ids must be in [0, {self.config.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]"
            )
        return self.weights["embed"][ids]

    def layer_forward(
        self, layer: int, hidden: torch.Tensor, hit_kv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer over the new tokens, attending to the cached prefix.

        Parameters
        ----------
        layer : int
            Layer index in ``[0, num_layers)``.
        hidden : torch.Tensor
            ``dtype [T_new, hidden]``, the new tokens' residual stream; they sit at positions
            ``T_hit .. T_hit + T_new - 1``.
        hit_kv : torch.Tensor, optional
            ``dtype [T_hit, 2, kv_heads, head_dim]``: K (after RoPE) and V of the cached prefix for this layer.

        Returns
        -------
        hidden_out : torch.Tensor
            ``dtype [T_new, hidden]``.
        miss_kv : torch.Tensor
            ``dtype [T_new, 2, kv_heads, head_dim]``: the new tokens' K (after RoPE) and V for this layer.
        """
        cfg = self.config
        if not 0 <= layer < cfg.num_layers:
            raise BoundsError(f"layer {layer} out of range [0, {cfg.num_layers})")
        kv_shape = (2, cfg.num_kv_heads, cfg.head_dim)
        if hit_kv is None:
            hit_kv = torch.empty((0, *kv_shape), dtype=self.dtype)
        if tuple(hit_kv.shape[1:]) != kv_shape or hit_kv.dtype != self.dtype:
            raise ValueError(
                f"hit_kv must be {self.dtype} [T_hit, {', '.join(map(str, kv_shape))}], "
                f"got {hit_kv.dtype} {list(hit_kv.shape)}"
            )
        num_hit, num_new = hit_kv.shape[0], hidden.shape[0]
        w = {name: self.weights[f"layers.{layer}.{name}"] for name in _LAYER_WEIGHTS}
        positions = torch.arange(num_hit, num_hit + num_new)

        normed = self._rms_norm(hidden, w["attn_norm"])
        query = self._rope((normed @ w["wq"]).view(num_new, cfg.num_heads, cfg.head_dim), positions)
        key = self._rope((normed @ w["wk"]).view(num_new, cfg.num_kv_heads, cfg.head_dim), positions)
        value = (normed @ w["wv"]).view(num_new, cfg.num_kv_heads, cfg.head_dim)
        miss_kv = torch.stack([key, value], dim=1)

        group = cfg.num_heads // cfg.num_kv_heads
        keys = torch.cat([hit_kv[:, 0], key]).repeat_interleave(group, dim=1)  # [T_all, heads, head_dim]
        values = torch.cat([hit_kv[:, 1], value]).repeat_interleave(group, dim=1)
        score_dtype = torch.float32 if self.dtype == torch.bfloat16 else self.dtype
        scores = torch.einsum("qhd,khd->hqk", query.to(score_dtype), keys.to(score_dtype)) / math.sqrt(cfg.head_dim)
        key_positions = torch.arange(num_hit + num_new)
        scores = scores.masked_fill(key_positions[None, None, :] > positions[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(self.dtype)
        attended = torch.einsum("hqk,khd->qhd", probs, values).reshape(num_new, cfg.num_heads * cfg.head_dim)
        hidden = hidden + attended @ w["wo"]

        normed = self._rms_norm(hidden, w["mlp_norm"])
        gated = torch.nn.functional.silu(normed @ w["w_gate"]) * (normed @ w["w_up"])
        return hidden + gated @ w["w_down"], miss_kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``dtype [T, hidden] -> dtype [T, vocab]``."""
        return self._rms_norm(hidden, self.weights["final_norm"]) @ self.weights["lm_head"]

    # -- whole passes -----------------------------------------------------------------------------------------------
    def prefill(
        self, token_ids: Sequence[int] | torch.Tensor, hit_kv: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill new tokens after a cached prefix, layer by layer.

        Parameters
        ----------
        token_ids : sequence of int or torch.Tensor
            The ``T_new`` tokens not covered by the cache.
        hit_kv : sequence of torch.Tensor, optional
            Per layer ``dtype [T_hit, 2, kv_heads, head_dim]``; None for no cached prefix.

        Returns
        -------
        logits : torch.Tensor
            ``dtype [T_new, vocab]``.
        miss_kv : list of torch.Tensor
            Per layer ``dtype [T_new, 2, kv_heads, head_dim]``.
        """
        if hit_kv is not None and len(hit_kv) != self.config.num_layers:
            raise ValueError(f"hit_kv needs {self.config.num_layers} layers, got {len(hit_kv)}")
        hidden = self.embed(token_ids)
        miss_kv = []
        for layer in range(self.config.num_layers):
            hidden, layer_kv = self.layer_forward(layer, hidden, None if hit_kv is None else hit_kv[layer])
            miss_kv.append(layer_kv)
        return self.logits(hidden), miss_kv

    def forward(self, token_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Full recompute: logits ``[T, vocab]`` and per-layer KV ``[T, 2, kv_heads, head_dim]`` of all tokens."""
        return self.prefill(token_ids, None)

    def generate_greedy(
        self, token_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, hit_kv: Sequence[torch.Tensor] | None = None
    ) -> list[int]:
        """Greedy decoding with a KV cache, starting from an optional cached prefix.

        ``token_ids`` are the tokens after the prefix that ``hit_kv`` covers; each step appends one token and
        runs the layers over it alone.
        """
        logits, kv = self.prefill(token_ids, hit_kv)
        if hit_kv is not None:
            kv = [torch.cat([hit, miss]) for hit, miss in zip(hit_kv, kv, strict=True)]
        generated: list[int] = []
        for step in range(max_new_tokens):
            generated.append(int(torch.argmax(logits[-1])))
            if step + 1 == max_new_tokens:
                break
            logits, new_kv = self.prefill([generated[-1]], kv)
            kv = [torch.cat([old, new]) for old, new in zip(kv, new_kv, strict=True)]
        return generated

    def generate_greedy_recompute(self, token_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy decoding that recomputes the whole sequence each step (no cache): the reference."""
        sequence = [int(t) for t in torch.as_tensor(token_ids).reshape(-1)]
        generated: list[int] = []
        for _ in range(max_new_tokens):
            logits, _ = self.forward(sequence)
            generated.append(int(torch.argmax(logits[-1])))
            sequence.append(generated[-1])
        return generated


_LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def _seeded_weights(config: TinyLlamaConfig) -> dict[str, torch.Tensor]:
    """float32 weights drawn from ``config.seed``; projections scaled by 1/sqrt(fan_in) to keep activations O(1)."""
    generator = torch.Generator().manual_seed(config.seed)

    def linear(fan_in: int, fan_out: int) -> torch.Tensor:
        return torch.randn(fan_in, fan_out, generator=generator) / math.sqrt(fan_in)

    def norm(width: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(width, generator=generator)

    hidden, q_width = config.hidden_size, config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    weights = {"embed": torch.randn(config.vocab_size, hidden, generator=generator)}
    for layer in range(config.num_layers):
        prefix = f"layers.{layer}."
        weights[prefix + "attn_norm"] = norm(hidden)
        weights[prefix + "wq"] = linear(hidden, q_width)
        weights[prefix + "wk"] = linear(hidden, kv_width)
        weights[prefix + "wv"] = linear(hidden, kv_width)
        weights[prefix + "wo"] = linear(q_width, hidden)
        weights[prefix + "mlp_norm"] = norm(hidden)
        weights[prefix + "w_gate"] = linear(hidden, config.intermediate_size)
        weights[prefix + "w_up"] = linear(hidden, config.intermediate_size)
        weights[prefix + "w_down"] = linear(config.intermediate_size, hidden)
    weights["final_norm"] = norm(hidden)
    weights["lm_head"] = linear(hidden, config.vocab_size)
    return weights
