"""Workload traces: a generator matching the DualPath paper's Table 2, its §A.3 replay, a loader
for the Mooncake FAST'25 JSONL, and the agent-trace file format (``TRACE.jsonl``) all of them can write.

A trajectory is a list of rounds ``(append_i, gen_i)``. Replay (§A.3): the prompt of round ``i`` is the
whole history ``A_1, G_1, ..., A_{i-1}, G_{i-1}`` plus ``A_i``; exactly ``gen_i`` tokens are generated.
Hits are within the trajectory: every full block of the history is in storage (persisted during the
previous rounds), so ``cached = floor(history / block) * block``.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ascend_dualpath import _env
from ascend_dualpath.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Round:
    """One replayed request: prompt and hit lengths, tokens to generate, arrival offset (s) if timed,
    and the tool latency (s) between its last token and the agent's next request."""

    prompt_tokens: int
    cached_tokens: int
    gen_tokens: int
    arrival_s: float | None = None
    tool_s: float = 0.0


@dataclass(frozen=True)
class TraceBucket:
    """Table 2 means for one max-length bucket."""

    max_len: int
    turns: float
    append: float
    gen: float


TABLE2 = {
    32768: TraceBucket(32768, 60, 608, 148),
    49152: TraceBucket(49152, 106, 474, 172),
    65536: TraceBucket(65536, 157, 429, 176),
}


def _bucket(max_len: int) -> TraceBucket:
    for key in (max_len, max_len * 1024):  # accept 64K given as 65536 or as 64
        if key in TABLE2:
            return TABLE2[key]
    raise ConfigError(f"no Table 2 bucket for max_len={max_len}; known: {sorted(TABLE2)}")


def generate_trajectories(max_len: int, count: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Synthetic trajectories whose means match Table 2 for the ``max_len`` bucket.

    Only the means are published, so the shapes are assumptions: turns ~ uniform on [turns/2, 3turns/2]
    (rounded), appends and generations ~ exponential around their means (heavy-ish tails like tool
    outputs), the first append 8x the mean (system prompt + task). A trajectory stops before its context
    would exceed ``max_len`` (the bucket's truncation), which lowers the realised turn mean slightly.
    Returns ``count`` lists of ``(append, gen)``.
    """
    if count < 1:
        raise ConfigError(f"count must be >= 1, got {count}")
    bucket = _bucket(max_len)
    rng = random.Random(seed)
    trajectories = []
    for _ in range(count):
        turns = max(1, round(rng.uniform(0.5, 1.5) * bucket.turns))
        rounds, context = [], 0
        for index in range(turns):
            scale = 8.0 if index == 0 else 1.0
            append = max(1, int(rng.expovariate(1.0 / (bucket.append * scale))))
            gen = max(1, int(rng.expovariate(1.0 / bucket.gen)))
            if context + append + gen > bucket.max_len:
                break
            rounds.append((append, gen))
            context += append + gen
        trajectories.append(rounds or [(min(bucket.max_len // 2, int(bucket.append)), 1)])
    return trajectories


def augment(trajectories: list[list[tuple[int, int]]], count: int, max_append: int, seed: int = 0):
    """More trajectories as in §A.3: a sampled one with a synthetic first round (random append, gen 1)."""
    rng = random.Random(seed)
    return [[(rng.randint(1, max_append), 1)] + list(rng.choice(trajectories)) for _ in range(count)]


def replay(trajectory: list[tuple[int, int]], block_tokens: int = 64) -> list[Round]:
    """The requests one trajectory issues (§A.3), with in-trajectory hits on full blocks."""
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
    rounds, history = [], 0
    for append, gen in trajectory:
        if append < 1 or gen < 1:
            raise ConfigError(f"round needs append >= 1 and gen >= 1, got ({append}, {gen})")
        cached = history // block_tokens * block_tokens
        rounds.append(Round(prompt_tokens=history + append, cached_tokens=cached, gen_tokens=gen))
        history += append + gen
    return rounds


def default_trace_dir() -> Path:
    """``ADP_TRACE_DIR`` if set, else the traces shipped in the package (``ascend_dualpath/sim/data``)."""
    configured = _env.trace_dir()
    return Path(configured) if configured else Path(__file__).resolve().parent / "data"


def default_mooncake_path() -> Path:
    return default_trace_dir() / "mooncake_conversation_trace.jsonl.gz"


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def iter_mooncake(path: Path | str | None = None, limit: int | None = None) -> Iterator[dict]:
    """Raw records of a Mooncake FAST'25 JSONL (plain or gzipped), validated."""
    path = Path(path) if path is not None else default_mooncake_path()
    if not path.exists():
        raise FileNotFoundError(f"Mooncake trace not found at {path}")
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if limit is not None and line_number > limit:
                return
            record = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in record:
                    raise ConfigError(f"{path}:{line_number}: record lacks {key!r}")
            blocks = math.ceil(record["input_length"] / MOONCAKE_BLOCK_TOKENS)
            if len(record["hash_ids"]) != blocks:
                raise ConfigError(
                    f"{path}:{line_number}: {len(record['hash_ids'])} hash ids for {record['input_length']} "
                    f"tokens, expected ceil(/{MOONCAKE_BLOCK_TOKENS}) = {blocks}"
                )
            yield record


def load_mooncake(path: Path | str | None = None, limit: int | None = None) -> list[Round]:
    """Mooncake requests as :class:`Round` with arrival times and storage hits.

    Each hash id names one 512-token prefix block; a request's hit is its longest prefix of ids already
    stored (unbounded cache), counted in *full* blocks only: a trailing partial block is never stored,
    so ``cached <= floor(input / 512) * 512``. After the request, its full blocks are stored.
    """
    stored: set[int] = set()
    rounds = []
    for record in iter_mooncake(path, limit):
        ids, length = record["hash_ids"], record["input_length"]
        full_blocks = length // MOONCAKE_BLOCK_TOKENS
        hit_blocks = 0
        while hit_blocks < full_blocks and ids[hit_blocks] in stored:
            hit_blocks += 1
        stored.update(ids[:full_blocks])
        rounds.append(
            Round(
                prompt_tokens=max(1, length),
                cached_tokens=hit_blocks * MOONCAKE_BLOCK_TOKENS,
                gen_tokens=max(1, record["output_length"]),
                arrival_s=record["timestamp"] / 1000.0,
            )
        )
    return rounds
