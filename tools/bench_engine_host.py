"""The CUDA transfer engine's own host work per request, on any machine: every CUDA call is a no-op.

    PYTHONPATH=. python3 tools/bench_engine_host.py

What a GPU run adds to these figures is the driver's time (graph launch, kernel launch) and the GPU's; what is left
here is the engine's Python between the caller and the driver: a prepared ``submit().wait()`` of 61 layer blocks,
and a repeated plain ``submit().wait()`` of 256 / 1024 / 4096 segments (per segment). The engine is the one of
``tests/transport/fake_cuda.py``: built without its constructor, its device work replaced by stand-ins that publish
at once.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.transport.fake_cuda import blocks, fake_engine  # noqa: E402


def per_call_us(call, repeats: int) -> float:
    for _ in range(min(repeats, 200)):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    engine = fake_engine()
    sources, slot = blocks(61, 42 * 1024)
    prepared = engine.prepare(sources, slot, notify_slot=0)
    us = per_call_us(lambda: prepared.submit().wait(), 20000)
    print(f"prepared 61 x 42 KiB submit().wait() with a notify slot: {us:.2f} us")
    for count in (256, 1024, 4096):
        sources, slot = blocks(count, 4096)
        us = per_call_us(lambda s=sources, r=slot: engine.submit(s, r, notify_slot=0).wait(), 2000)
        print(f"plain submit().wait() of {count} x 4 KiB, repeated: {us:.2f} us ({us / count:.4f} us per segment)")


if __name__ == "__main__":
    main()
