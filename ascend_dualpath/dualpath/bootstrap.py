"""Starting a prefill/decode engine pair: both in this process (fast tests, the same code paths) or one engine
per process (``torch.distributed`` control channel); either way both join one emulated fabric and their halves
talk over their side channels."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.channels import DistChannel, QueueChannel
from ascend_dualpath.dualpath.dataplane import PE_RANK, EngineFactory
from ascend_dualpath.dualpath.nodes import (
    KV_BF16_ATOL,
    KV_FP32_ATOL,
    DecodeEngine,
    EngineConfig,
    PrefillEngine,
    TurnResult,
    verify_turn,
)
from ascend_dualpath.kv.faults import FaultInjector


@contextlib.contextmanager
def in_process_engines(
    config: EngineConfig,
    pe_faults: FaultInjector | None = None,
    de_faults: FaultInjector | None = None,
    engines: EngineFactory | None = None,
) -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    """Both engines in this process, on the emulated fabric ``config.fabric`` (their pair link in the KV traffic
    class), the PE serving on a thread.

    ``engines(comm, rank)`` makes the TransferEngine that a link of communicator ``comm`` uses to write to ``rank``
    (None: :func:`~ascend_dualpath.transport.create_engine` of the emulator, the links' default)."""
    pe_end, de_end = QueueChannel.pair()
    pe = PrefillEngine(config, pe_end, pe_faults, engines)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            pe.serve()
        except BaseException as error:  # surfaced by the main thread
            failure.append(error)

    thread = threading.Thread(target=serve, name="adp-prefill-engine", daemon=True)
    thread.start()
    de = None
    try:  # the DE's set-up may fail (the PE refused it): the PE still closes
        de = DecodeEngine(config, de_end, de_faults, engines)
        yield pe, de
    finally:
        de_end.send(m.Stop())  # what DecodeEngine.stop_peer sends
        thread.join(config.timeout_s)
        if de is not None:
            de.close()
        pe.close()
        if failure:
            raise failure[0]


def engine_process(rank: int, port: int, fabric_name: str, config: EngineConfig, job: dict, events: Any) -> None:
    """Entry point of one engine process (rank 0 = PE, 1 = DE) on fabric ``fabric_name``; the DE reports events on
    ``events``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=config.timeout_s * 4),
    )
    engine = None
    config = dataclasses.replace(config, fabric=fabric_name)
    try:
        channel = DistChannel(1 - rank, "decode engine" if rank == PE_RANK else "prefill engine")
        try:
            if rank == PE_RANK:
                engine = PrefillEngine(config, channel)
                events.put(("pe_pid", _pid()))
                engine.serve()
            else:
                engine = DecodeEngine(config, channel)
                _drive(engine, config, job, events)
        finally:
            if engine is not None:
                engine.close()
    except BaseException as error:
        events.put(
            ("error", "prefill engine" if rank == PE_RANK else "decode engine", f"{type(error).__name__}: {error}")
        )
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _pid() -> int:
    import os

    return os.getpid()


def _drive(engine: DecodeEngine, config: EngineConfig, job: dict, events: Any) -> None:
    conversations = job["conversations"]
    prompts: dict[tuple[int, int], list[int]] = {}

    def on_turn(result: TurnResult) -> None:
        prompts[(result.agent_id, result.turn)] = result.sequence[: result.prompt_tokens] if result.sequence else []
        events.put(("turn", {k: v for k, v in dataclasses.asdict(result).items() if k not in ("kv", "sequence")}))

    summary = engine.run_conversations(conversations, job["mode"], on_turn)
    engine.stop_peer()
    checks = []
    if config.verify:
        reference = engine.model.with_dtype(torch.float64)
        atol = KV_BF16_ATOL if config.torch_dtype == torch.bfloat16 else KV_FP32_ATOL
        for result in summary["results"]:
            if result.error is not None:
                continue
            check = verify_turn(
                result,
                prompts[(result.agent_id, result.turn)],
                engine.model,
                reference,
                engine.store,
                engine.namespace,
                atol,
                teacher_forced=True,
            )
            checks.append(check)
            events.put(("verified", result.agent_id, result.turn, check))
    summary.pop("results")
    summary["checks"] = checks
    events.put(("done", summary))
