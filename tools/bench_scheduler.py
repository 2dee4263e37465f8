"""Benchmark: microseconds per scheduling decision of the DualPath scheduler.

A decision = one request admitted to a DE (phase 1 + phase 2) and placed on a PE with its read path.
Cluster: ``--engines`` engines in groups of ``--group-size`` (half prefill, half decode groups).
Each round submits a burst of requests and lets every group pull once, with engine loads drawn at
random (seeded), so that categories, beta and Z are all exercised.

    PYTHONPATH=$PWD python3 tools/bench_scheduler.py --engines 1000 --group-size 8
"""

from __future__ import annotations

import argparse
import random
import time

from ascend_dualpath.dualpath.scheduler import EngineState, GroupReport, Request, Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--requests-per-round", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    groups = args.engines // args.group_size
    pe_groups, de_groups = list(range(groups // 2)), list(range(groups // 2, groups))
    alpha, beta = 3_750_000, 1_400_000
    scheduler = Scheduler(alpha=alpha, beta=beta)
    for group in de_groups:
        scheduler.register_decode_group(group)

    def report(group: int, decode: bool) -> GroupReport:
        base = group * args.group_size
        engines = [
            EngineState(
                base + i,
                group,
                seqs=rng.randint(0, 40),
                tokens=rng.randint(0, beta + beta // 4),
                free_hbm_bytes=rng.randint(0, 50 * 10**9) if decode else 0,
            )
            for i in range(args.group_size)
        ]
        return GroupReport(group, engines, {group: rng.randint(0, 2 * alpha)})

    reports = [(g, report(g, True)) for g in de_groups] + [(g, report(g, False)) for g in pe_groups]
    request_id, decided, elapsed = 0, 0, 0.0
    for _ in range(args.rounds):
        for _ in range(args.requests_per_round):
            tokens = rng.randint(1000, 65536)
            scheduler.submit(Request(request_id, tokens, tokens // 64 * 64 - 64 if tokens > 64 else 0, tokens * 40_000))
            request_id += 1
        start = time.perf_counter()
        for group, group_report in reports:
            if group in de_groups:
                scheduler.pull_decode(group_report)
            else:
                decided += len(scheduler.pull_prefill(group_report))
        elapsed += time.perf_counter() - start
    print(
        f"engines={args.engines} groups={groups} (PE {len(pe_groups)}, DE {len(de_groups)}) "
        f"decisions={decided} total={elapsed:.3f}s per_decision_us={1e6 * elapsed / max(1, decided):.2f}"
    )


if __name__ == "__main__":
    main()
