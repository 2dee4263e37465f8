"""The agent-trace file format (``TRACE.jsonl``): one agent per line, read, validated and written.

One line is one agent::

    {"agent": "a1", "start_s": 12.5, "max_context": 65536,
     "turns": [{"input": 3400, "output": 180, "tool_s": 2.0},
               {"input": 420, "output": 95, "reset": true},
               {"input": 12000, "output": 40, "cached": 8192}]}

``agent`` names it (unique in the file); ``start_s`` (optional, >= 0) is when its first turn arrives in an
online run (offline runs start every agent at 0); ``max_context`` (optional) is the context cap no turn's
prompt plus output may exceed. Per turn: ``input`` is the turn's new tokens (the first turn's is the initial
prompt), ``output`` the generated tokens, ``tool_s`` (optional) the tool latency before the next turn,
``reset`` (optional) starts the context over (no prefix hit, the history is dropped). The prompt of a turn is
the history (every earlier input and output since the last reset) plus its input; its storage hit is every
full KV block of that history (§A.3 replay). ``cached`` (optional, an extension the Mooncake loader needs)
overrides that hit with the given token count, for hits that come from other agents' prefixes.

Files may be gzipped (``.gz``). Every error is a :class:`~ascend_dualpath.errors.ConfigError` naming the file,
the line, the field and its limit.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.traces import Round, generate_trajectories, load_mooncake

_AGENT_KEYS = {"agent", "start_s", "max_context", "turns"}
_TURN_KEYS = {"input", "output", "tool_s", "reset", "cached"}


@dataclass(frozen=True)
class Turn:
    """One turn of an agent: new tokens in, tokens out, tool latency after it, context reset before it, and
    an optional explicit storage hit (tokens)."""

    input: int
    output: int
    tool_s: float = 0.0
    reset: bool = False
    cached: int | None = None


@dataclass(frozen=True)
class AgentTrace:
    """One agent: its name, turns, online arrival time (None: 0) and context cap (None: unbounded)."""

    agent: str
    turns: tuple[Turn, ...]
    start_s: float | None = None
    max_context: int | None = None

    def rounds(self, block_tokens: int = 64) -> list[Round]:
        """The requests this agent issues (§A.3 replay, resets and explicit hits applied).

        Parameters
        ----------
        block_tokens : int
            KV block size in tokens; a hit covers whole blocks of the history only.

        Returns
        -------
        list[Round]
            One per turn, ``tool_s`` carried over.
        """
        if block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
        rounds, history = [], 0
        for index, turn in enumerate(self.turns):
            if turn.reset:
                history = 0
            prompt = history + turn.input
            if self.max_context is not None and prompt + turn.output > self.max_context:
                raise ConfigError(
                    f"agent {self.agent!r} turns[{index}]: context {prompt} + output {turn.output} "
                    f"exceeds max_context {self.max_context}"
                )
            cached = history // block_tokens * block_tokens if turn.cached is None else turn.cached
            if cached > prompt:
                raise ConfigError(
                    f"agent {self.agent!r} turns[{index}].cached={cached} exceeds its prompt of {prompt} tokens"
                )
            rounds.append(Round(prompt, cached, turn.output, tool_s=turn.tool_s))
            history = prompt + turn.output
        return rounds


def _int_field(record: dict, key: str, where: str, minimum: int, required: bool = True) -> int | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds_field(record: dict, key: str, where: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.{key} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _unknown(record: dict, known: set[str], where: str) -> None:
    extra = sorted(set(record) - known)
    if extra:
        raise ConfigError(f"{where}: unknown field {extra[0]!r}; known: {sorted(known)}")


def _parse_turn(record: object, where: str) -> Turn:
    if not isinstance(record, dict):
        raise ConfigError(f"{where} must be an object, got {type(record).__name__}")
    _unknown(record, _TURN_KEYS, where)
    reset = record.get("reset", False)
    if not isinstance(reset, bool):
        raise ConfigError(f"{where}.reset must be true or false, got {reset!r}")
    return Turn(
        input=_int_field(record, "input", where, 1),
        output=_int_field(record, "output", where, 1),
        tool_s=_seconds_field(record, "tool_s", where) or 0.0,
        reset=reset,
        cached=_int_field(record, "cached", where, 0, required=False),
    )


def parse_agent(record: object, where: str) -> AgentTrace:
    """One agent from its decoded JSON object; ``where`` prefixes every error (e.g. ``"trace.jsonl:3"``)."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    _unknown(record, _AGENT_KEYS, where)
    name = record.get("agent")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.agent must be a non-empty string, got {name!r}")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}.turns must be a non-empty list, got {turns!r}")
    agent = AgentTrace(
        agent=name,
        turns=tuple(_parse_turn(turn, f"{where}.turns[{i}]") for i, turn in enumerate(turns)),
        start_s=_seconds_field(record, "start_s", where),
        max_context=_int_field(record, "max_context", where, 2, required=False),
    )
    try:
        agent.rounds()  # context cap and explicit hits checked here, once, with the file position
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    return agent


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else open(path, mode)


def read_agent_trace(path: Path | str) -> list[AgentTrace]:
    """Every agent of a ``TRACE.jsonl`` (plain or gzipped); blank lines are skipped.

    Raises
    ------
    ConfigError
        The file is missing, a line is not JSON, a field is missing or out of range (the message names the
        line, the field and the limit), two agents share a name, or the file holds no agent.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"trace file {path} not found")
    agents, names = [], set()
    with _open(path, "r") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
            agent = parse_agent(record, where)
            if agent.agent in names:
                raise ConfigError(f"{where}.agent {agent.agent!r} appears twice; names must be unique")
            names.add(agent.agent)
            agents.append(agent)
    if not agents:
        raise ConfigError(f"trace file {path} holds no agent")
    return agents


def agent_record(agent: AgentTrace) -> dict:
    """The JSON object of one agent, optional fields left out at their defaults."""
    record: dict = {"agent": agent.agent}
    if agent.start_s is not None:
        record["start_s"] = agent.start_s
    if agent.max_context is not None:
        record["max_context"] = agent.max_context
    turns = []
    for turn in agent.turns:
        item: dict = {"input": turn.input, "output": turn.output}
        if turn.tool_s:
            item["tool_s"] = turn.tool_s
        if turn.reset:
            item["reset"] = True
        if turn.cached is not None:
            item["cached"] = turn.cached
        turns.append(item)
    record["turns"] = turns
    return record


def write_agent_trace(path: Path | str, agents: Iterable[AgentTrace]) -> Path:
    """Write ``agents`` as a ``TRACE.jsonl`` (gzipped if the name ends in ``.gz``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "w") as handle:
        for agent in agents:
            handle.write(json.dumps(agent_record(agent), separators=(",", ":")) + "\n")
    return path


def table2_trace(count: int, max_len: int = 65536, seed: int = 0) -> list[AgentTrace]:
    """``count`` agents of the Table-2 generator (:func:`~ascend_dualpath.sim.traces.generate_trajectories`),
    with ``max_context`` the bucket's length; their rounds equal :func:`~ascend_dualpath.sim.traces.replay`'s."""
    trajectories = generate_trajectories(max_len, count, seed=seed)
    cap = max_len if max_len > 1024 else max_len * 1024
    return [
        AgentTrace(
            agent=f"table2-{index}", turns=tuple(Turn(append, gen) for append, gen in trajectory), max_context=cap
        )
        for index, trajectory in enumerate(trajectories)
    ]


def mooncake_trace(path: Path | str | None = None, limit: int | None = None) -> list[AgentTrace]:
    """The Mooncake FAST'25 trace as agents of one turn each, arriving at the record's timestamp, with the
    cross-request prefix hit as the turn's explicit ``cached`` (see :func:`~ascend_dualpath.sim.traces.load_mooncake`)."""
    return [
        AgentTrace(
            agent=f"mooncake-{index}",
            start_s=rnd.arrival_s,
            turns=(Turn(rnd.prompt_tokens, rnd.gen_tokens, cached=rnd.cached_tokens),),
        )
        for index, rnd in enumerate(load_mooncake(path, limit))
    ]


def agents_rounds(agents: Sequence[AgentTrace], block_tokens: int = 64) -> list[list[Round]]:
    """The simulator's input: each agent's rounds."""
    return [agent.rounds(block_tokens) for agent in agents]
