"""alpha and beta measured when the proxy starts (the CLI's defaults when ``--alpha-tokens`` / ``--beta-tokens``
are not given), kept simple:

- alpha = the tokens the fastest node's storage NIC reads in 3 s (paper §A.4; the placement scales every node's
  read queue to that rate, so alpha is 3 s of backlog on each): a node's cap is the sum of its
  instances' ``snic_bytes_per_s`` (status replies), over ``kv_bytes_per_token`` (the CLI's
  ``--kv-bytes-per-token``; ``serve`` computes it from the model's config). Unknown (a node uncapped, or no
  bytes per token) leaves alpha unbounded: every node then qualifies for category 2.
- beta = the tokens one PE prefills in 5 s, from a timed warm-up: a plain (no ``kv_transfer_params``)
  ``max_tokens: 1`` completion of ``warmup_tokens`` numbers sent to the first PE twice, the second (other numbers:
  nothing of it is stored yet) timed; the first pays the first-request costs.

Both need the instances up: the measurement first waits (bounded by ``startup_timeout_s``) until every instance
answers ``/health`` (``serve`` starts the proxy together with the instances).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import zmq.asyncio

from ascend_dualpath.dualpath.scheduler import ALPHA_WINDOW_S, BETA_WINDOW_S
from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S
from ascend_dualpath.errors import ProtocolError, WaitTimeout
from ascend_dualpath.integrations.vllm.cluster import Cluster, Instance
from ascend_dualpath.integrations.vllm.proxy import ProxyConfig, query_status

WARMUP_TOKENS = 256


def alpha_from_status(cluster: Cluster, status: dict[str, dict | None], kv_bytes_per_token: int | None) -> int | None:
    """alpha in tokens from the status replies by instance name (see the module docstring); None when unknown."""
    if not kv_bytes_per_token:
        return None
    caps: dict[str, float] = {}
    for instance in cluster.instances:
        rate = (status.get(instance.name) or {}).get("snic_bytes_per_s")
        if not isinstance(rate, int | float) or rate <= 0 or rate >= UNCAPPED_BYTES_PER_S:
            return None
        caps[instance.node] = caps.get(instance.node, 0.0) + rate
    return int(max(caps.values()) * ALPHA_WINDOW_S / kv_bytes_per_token)


def beta_from_warmup(tokens: int, seconds: float) -> int:
    """beta in tokens: the rate of one timed prefill of ``tokens`` tokens in ``seconds``, over 5 s."""
    return int(tokens / max(seconds, 1e-6) * BETA_WINDOW_S)


async def _statuses(cfg: ProxyConfig) -> dict[str, dict | None]:
    ctx = zmq.asyncio.Context()

    async def one(instance: Instance) -> dict | None:
        try:
            return await query_status(ctx, instance.kv, cfg.status_timeout_s, cfg.side_token)
        except (WaitTimeout, ProtocolError, zmq.ZMQError, asyncio.TimeoutError):
            return None

    try:
        replies = await asyncio.gather(*(one(i) for i in cfg.cluster.instances))
    finally:
        ctx.term()
    return {i.name: r for i, r in zip(cfg.cluster.instances, replies, strict=True)}


async def wait_for_instances(cfg: ProxyConfig, timeout_s: float, poll_s: float = 0.5) -> list[str]:
    """Poll every instance's ``/health`` until all answer 200 or ``timeout_s`` passed; the names still down."""
    deadline = time.monotonic() + timeout_s
    pending = list(cfg.cluster.servers)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=min(cfg.status_timeout_s, 5.0))) as session:
        while pending:
            for instance in list(pending):
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(instance.url + "/health") as resp:
                        if resp.status == 200:
                            pending.remove(instance)
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(poll_s)
    return [i.name for i in pending]


async def _timed_prefill(cfg: ProxyConfig, warmup_tokens: int) -> float:
    """Seconds of the second of two one-token completions of different prompts on the first PE."""
    url = cfg.cluster.prefill[0].url
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        elapsed = 0.0
        for first in (0, warmup_tokens):
            prompt = " ".join(str(n) for n in range(first, first + warmup_tokens))
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.monotonic()
            async with session.post(url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                await resp.read()
            elapsed = time.monotonic() - start
    return elapsed


async def measure_thresholds(
    cfg: ProxyConfig,
    kv_bytes_per_token: int | None = None,
    warmup_tokens: int = WARMUP_TOKENS,
    startup_timeout_s: float = 300.0,
) -> tuple[int | None, int | None, str]:
    """``(alpha, beta, how)`` for the thresholds ``cfg`` leaves None (a given one is returned as it is); ``how``
    says where each came from, for the proxy's start-up line."""
    alpha, beta, notes = cfg.alpha_tokens, cfg.beta_tokens, []
    if alpha is None or beta is None:
        down = await wait_for_instances(cfg, startup_timeout_s)
        if down:
            notes.append(f"{down} not up within {startup_timeout_s} s")
    if alpha is None:
        alpha = alpha_from_status(cfg.cluster, await _statuses(cfg), kv_bytes_per_token)
        notes.append("alpha unbounded (no storage-NIC cap or KV bytes per token known)" if alpha is None else
                     f"alpha {alpha} tokens from the storage-NIC caps")  # fmt: skip
    if beta is None:
        try:
            seconds = await _timed_prefill(cfg, warmup_tokens)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, KeyError, ValueError) as exc:
            notes.append(f"beta unbounded (warm-up prefill failed: {exc!r})")
        else:
            beta = beta_from_warmup(warmup_tokens, seconds)
            notes.append(f"beta {beta} tokens from a {warmup_tokens}-token warm-up prefill of {seconds:.3f} s")
    return alpha, beta, "; ".join(notes) or "alpha and beta given"
