"""Small models shipped with the package for demos and tests (weights generated from a seed, no download)."""

from __future__ import annotations

from ascend_dualpath.models.tiny_llama import TinyLlama, TinyLlamaConfig

__all__ = ["TinyLlama", "TinyLlamaConfig"]
