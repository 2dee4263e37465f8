"""Synthetic multi-turn agentic conversations, shaped like the DualPath paper's Table 2 but scaled down.

Table 2 (32K traces): 60 turns, 608 appended and 148 generated tokens per turn on average, context 17K. An
agent's turn ``k`` prompt is everything so far (previous prompts and generated tokens) plus the new append, so
all but the append is a cached prefix once the previous turn's KV was persisted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ascend_dualpath.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Turn:
    append: tuple[int, ...]  # new tokens the environment or user adds this turn
    gen_tokens: int  # tokens the model generates (greedy)


@dataclasses.dataclass(frozen=True)
class Conversation:
    agent_id: int
    turns: tuple[Turn, ...]

    def max_context(self) -> int:
        return sum(len(t.append) + t.gen_tokens for t in self.turns)


def synthetic_conversations(
    agents: int = 8,
    turns: int = 6,
    first_prompt: int = 640,
    append_mean: int = 76,
    gen_tokens: int = 4,
    vocab_size: int = 512,
    seed: int = 0,
) -> list[Conversation]:
    """``agents`` conversations of ``turns`` turns: a ``first_prompt``-token first turn, then appends of
    ``append_mean`` tokens on average (uniform in [append_mean/2, 3*append_mean/2]); token ids uniform in the
    vocabulary, all drawn from ``seed``."""
    if agents < 1 or turns < 1 or first_prompt < 1 or append_mean < 1 or gen_tokens < 1:
        raise ConfigError(
            f"agents={agents}, turns={turns}, first_prompt={first_prompt}, append_mean={append_mean} "
            f"and gen_tokens={gen_tokens} must all be >= 1"
        )
    rng = np.random.default_rng(seed)
    out = []
    for agent in range(agents):
        lengths = [first_prompt] + [
            int(rng.integers(max(1, append_mean // 2), append_mean * 3 // 2 + 1)) for _ in range(turns - 1)
        ]
        out.append(
            Conversation(
                agent, tuple(Turn(tuple(int(t) for t in rng.integers(0, vocab_size, n)), gen_tokens) for n in lengths)
            )
        )
    return out
