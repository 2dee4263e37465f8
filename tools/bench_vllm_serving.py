"""Multi-turn agents through a P/D pair on real vLLM (CPU): DualPath ``dual`` vs ``pe`` vs vLLM's ExampleConnector.

    python3 tools/bench_vllm_serving.py [--agents 4] [--turns 4] [--snic-mbps 4] [--policies dual,pe,dual+split]
        [--repeats 3] [--out x.json]

Each agent opens with a long prompt and then appends a short user message per turn (the prompt extends the
previous turn and its answer), so after the first turn almost every prompt token is a storage hit. The storage
NICs are capped (``--snic-mbps`` per instance) so that reading binds. Measured per deployment, in one run: job
completion time (all agents, all turns) and TTFT p50/p99 (first streamed chunk at the client), plus whether each
turn's greedy text equals plain vLLM's, and how busy each storage NIC was over the hit phase (the proxy's
``adp_snic_read_bytes`` sampled every ``SAMPLE_S``: a NIC is busy in an interval where its bytes grew; the hit phase
runs from the first interval any NIC read in to the last). ``dual+split`` is ``serve --policy dual --split``;
``--repeats`` runs every policy that many times in one run, interleaved. The baseline is a plain vLLM P/D pair with vLLM's own
``ExampleConnector`` (the prefill saves each whole prompt's KV to shared storage, the decode loads the whole
prefix before decoding); its reads are not capped (it has no storage-NIC model), which favours it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
STARTUP_S = 600
SAMPLE_S = 0.2


def _words(model: str) -> list[str]:
    vocab = json.loads(Path(model, "tokenizer.json").read_text())["model"]["vocab"]
    return [w for w in vocab if w.isalpha()][:400]


def conversations(model: str, agents: int, turns: int, opening: int, append: int) -> list[list[str]]:
    words = _words(model)
    out = []
    for a in range(agents):
        first = " ".join(words[(a * 53 + 7 * i) % len(words)] for i in range(opening))
        rest = [" ".join(words[(a * 17 + t * 31 + i) % len(words)] for i in range(append)) for t in range(1, turns)]
        out.append([first, *rest])
    return out


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, float, float]:
    """(text, ttft_s, total_s) of one streamed completion."""
    start = time.perf_counter()
    ttft, text = None, []
    async with session.post(url, json={**body, "stream": True}) as reply:
        reply.raise_for_status()
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "choices" not in event:
                raise RuntimeError(f"{url} answered {event}")
            chunk = event["choices"][0]["text"]
            if ttft is None and chunk:
                ttft = time.perf_counter() - start
            text.append(chunk)
    return "".join(text), ttft or 0.0, time.perf_counter() - start


async def run_agents(target, model: str, convs: list[list[str]], gen: int) -> dict:
    """Every agent's turns in order, agents concurrently; returns texts, TTFTs and the job completion time."""
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def agent(turns: list[str]) -> list[tuple[str, float]]:
            prompt, out = "", []
            for append in turns:
                prompt = f"{prompt} {append}".strip()
                body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True}
                text, ttft = await target(session, body)
                out.append((text, ttft))
                prompt += text
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(agent(turns) for turns in convs))
        jct = time.perf_counter() - start
    texts = [[t for t, _ in r] for r in results]
    ttfts = [ttft for r in results for _, ttft in r[1:]]  # turns after the first: the storage-hit turns
    return {
        "jct_s": jct,
        "texts": texts,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": sorted(ttfts)[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def _wait(url: str, proc: subprocess.Popen, log: str | None = None) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log).read_text()[-3000:] if log else ""
            raise SystemExit(f"{url}: process exited with {proc.returncode} during start-up\n{tail}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not come up within {STARTUP_S} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def model_dir(given: str | None):
    """The model to serve: ``given``, or a fresh make-tiny-model in a temporary directory that is removed when the
    run ends, also on an error, Ctrl-C or SIGTERM (turned into ``SystemExit`` so every ``finally`` runs)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if given:
        yield given
        return
    from ascend_dualpath.models.tiny_hf import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="adp-bench-model-") as tmp:
        yield str(make_tiny_model(tmp))


def bench_serve(model: str, policy: str, args, port: int, convs) -> dict:
    base, _, split = policy.partition("+")
    with tempfile.TemporaryDirectory(prefix="adp-bench-") as tmp:
        argv = [
            sys.executable,
            "-m",
            "ascend_dualpath",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--policy",
            base,
            *(["--split"] if split == "split" else []),
            "--snic-mbps",
            str(args.snic_mbps),
            "--store",
            f"{tmp}/store",
            "--timeout",
            "120",
        ]
        with open(f"{tmp}/serve.log", "w") as log:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait(f"{url}/health", proc)

            async def target(session, body):
                text, ttft, _ = await _stream(session, f"{url}/v1/completions", body)
                return text, ttft

            import urllib.request

            with NicSampler(f"{url}/metrics") as sampler:
                result = asyncio.run(run_agents(target, model, convs, args.gen))
            result["nic_busy"] = sampler.busy_fractions()

            result["metrics"] = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
            decisions = urllib.request.urlopen(f"{url}/debug/decisions", timeout=10).read()
            result["decisions"] = json.loads(decisions)  # each request's path, the queues it saw, its hits
            return result
        finally:
            _stop(proc)


# vLLM 0.32.0's CPU attention dies with SIGILL on the decode side of a P/D pair unless the process asked Linux for
# the AMX tile state first (the DualPath worker does); give the baseline the same.
AMX_SITECUSTOMIZE = "from ascend_dualpath._platform import request_amx_state\nrequest_amx_state()\n"


def _api_server(model: str, port: int, log: str, extra: list[str] = (), env: dict | None = None) -> subprocess.Popen:
    """vLLM's OpenAI API server (``vllm serve``'s server) of ``model`` on ``port``, in its own session."""
    from ascend_dualpath.integrations.vllm.serve import server_argv

    return subprocess.Popen(
        [*server_argv(model, port), *extra],
        env={**os.environ, **ENV, **(env or {})},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@contextlib.contextmanager
def plain_server(model: str, port: int):
    """One plain vLLM server, no P/D and no connector, for as long as the block runs; yields the agents' target."""
    with tempfile.TemporaryDirectory(prefix="adp-bench-plain-") as tmp:
        proc = _api_server(model, port, f"{tmp}/plain.log", env={"TMPDIR": tmp})  # its IPC sockets go with tmp
        try:
            _wait(f"http://127.0.0.1:{port}/health", proc, f"{tmp}/plain.log")

            async def target(session, body):
                text, ttft, _ = await _stream(session, f"http://127.0.0.1:{port}/v1/completions", body)
                return text, ttft

            yield target
        finally:
            _stop(proc)


def bench_plain(model: str, args, port: int, convs) -> dict:
    """One plain vLLM server: the floor of the job's time."""
    with plain_server(model, port) as target:
        return asyncio.run(run_agents(target, model, convs, args.gen))


def _snic_bytes(metrics: str, by_instance: bool = False) -> dict[str, float]:
    """Bytes read through the storage NICs of the PEs ("pe") and of the DEs ("de"), from the proxy's /metrics
    (``by_instance``: per instance name instead)."""
    from prometheus_client.parser import text_string_to_metric_families

    read: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "adp_snic_read_bytes":
                name = sample.labels["instance"]
                side = name if by_instance else ("pe" if name.startswith("prefill") else "de")
                read[side] = read.get(side, 0.0) + sample.value
    return read


class NicSampler:
    """Samples each instance's storage-NIC read bytes from the proxy's ``/metrics`` every ``SAMPLE_S`` on a thread
    while the ``with`` block runs; :meth:`busy_fractions` says how busy each NIC was over the hit phase."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.samples, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="nic-sampler", daemon=True)

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(SAMPLE_S):
            try:
                text = urllib.request.urlopen(self.url, timeout=5).read().decode()
            except OSError:
                continue  # a scrape lost under load: the interval merges with the next
            self.samples.append((time.perf_counter(), _snic_bytes(text, by_instance=True)))

    def __enter__(self) -> NicSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def busy_fractions(self) -> dict[str, float]:
        """Instance -> the fraction of the hit phase (first to last interval any NIC read in) its NIC read in."""
        grew = [
            (t1 - t0, {k for k, v in b.items() if v > a.get(k, 0.0)})
            for (t0, a), (t1, b) in zip(self.samples, self.samples[1:], strict=False)
        ]
        active = [i for i, (_, names) in enumerate(grew) if names]
        if not active:
            return {}
        phase = grew[active[0] : active[-1] + 1]
        total = sum(dt for dt, _ in phase)
        names = {k for _, b in self.samples for k in b}
        return {k: sum(dt for dt, busy in phase if k in busy) / total for k in sorted(names)}


def bench_example(model: str, args, ports: tuple[int, int], convs) -> dict:
    with tempfile.TemporaryDirectory(prefix="adp-bench-example-") as tmp:
        Path(tmp, "site").mkdir()
        Path(tmp, "site", "sitecustomize.py").write_text(AMX_SITECUSTOMIZE)
        pythonpath = os.pathsep.join(filter(None, [f"{tmp}/site", os.environ.get("PYTHONPATH")]))
        procs = []
        for role, port, bind in (("kv_producer", ports[0], "0"), ("kv_consumer", ports[1], "1")):
            kv = {
                "kv_connector": "ExampleConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/shared"},
            }
            env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "PYTHONPATH": pythonpath}
            procs.append(_api_server(model, port, f"{tmp}/{role}.log", ["--kv-transfer-config", json.dumps(kv)], env))
        try:
            for port, proc, role in zip(ports, procs, ("kv_producer", "kv_consumer"), strict=True):
                _wait(f"http://127.0.0.1:{port}/health", proc, f"{tmp}/{role}.log")
            prefill, decode = (f"http://127.0.0.1:{p}" for p in ports)

            async def target(session, body):
                start = time.perf_counter()
                async with session.post(f"{prefill}/v1/completions", json={**body, "max_tokens": 1}) as reply:
                    reply.raise_for_status()
                    await reply.read()
                prefilled = time.perf_counter() - start
                text, ttft, _ = await _stream(session, f"{decode}/v1/completions", body)
                return text, prefilled + ttft  # the client's first token comes after both legs

            try:
                return asyncio.run(run_agents(target, model, convs, args.gen))
            except (RuntimeError, aiohttp.ClientError) as error:
                log = Path(tmp, "kv_consumer.log").read_text()
                cause = [line for line in log.splitlines() if "Error" in line or "Fatal" in line][-5:]
                return {"error": f"{error}", "decode_log": cause}
        finally:
            for proc in procs:
                _stop(proc)


def add_workload_arguments(
    parser: argparse.ArgumentParser, agents: int, turns: int, gen: int, snic_mbps: float
) -> None:
    """The options every serving benchmark shares: the model, the agents' conversations, the storage-NIC cap and
    where the JSON goes (the defaults are each benchmark's own)."""
    parser.add_argument("--model", default=None, help="model directory (default: a fresh make-tiny-model)")
    parser.add_argument("--agents", type=int, default=agents)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--opening", type=int, default=1200, help="words of each agent's first prompt")
    parser.add_argument("--append", type=int, default=48, help="words each later turn appends")
    parser.add_argument("--gen", type=int, default=gen, help="tokens generated per turn")
    parser.add_argument("--snic-mbps", type=float, default=snic_mbps, help="storage-NIC cap of each node, MB/s")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, agents=4, turns=4, gen=16, snic_mbps=4.0)
    parser.add_argument("--skip-example", action="store_true", help="leave out the ExampleConnector baseline")
    parser.add_argument(
        "--policies",
        default="dual,pe",
        help="DualPath read-path policies (dual, pe, de, dual+split), one deployment each",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of every policy, interleaved, in one run")
    args = parser.parse_args()
    for policy in args.policies.split(","):
        if policy.partition("+")[0] not in ("dual", "pe", "de") or policy.partition("+")[2] not in ("", "split"):
            parser.error(f"--policies: {policy!r} is not dual, pe or de, optionally +split")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    with model_dir(args.model) as model:
        return run(args, model)


def run(args, model: str) -> int:
    from ascend_dualpath.integrations.vllm.serve import pick_instance_ports

    convs = conversations(model, args.agents, args.turns, args.opening, args.append)
    policies = args.policies.split(",")
    ports = iter(pick_instance_ports(len(policies) * args.repeats + 3))
    results = {}
    for repeat in range(args.repeats):
        for policy in policies:
            name = policy if args.repeats == 1 else f"{policy}#{repeat + 1}"
            results[name] = bench_serve(model, policy, args, next(ports), convs)
    if not args.skip_example:
        results["example"] = bench_example(model, args, (next(ports), next(ports)), convs)
    results["plain"] = bench_plain(model, args, next(ports), convs)
    reference = results["plain"]["texts"]
    print(f"{args.agents} agents x {args.turns} turns, SNIC cap {args.snic_mbps} MB/s per instance")
    print(
        f"{'deployment':<14}{'JCT s':>9}{'TTFT p50 s':>12}{'TTFT p99 s':>12}  text = plain's  SNIC MB read (pe/de)"
        "  NIC busy (pe/de)"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<12}failed: {r['error']}; decode log: {r['decode_log']}")
            continue
        same = sum(a == b for x, y in zip(r["texts"], reference, strict=True) for a, b in zip(x, y, strict=True))
        read = _snic_bytes(r["metrics"]) if "metrics" in r else {}
        r["snic_read_bytes"] = read
        snic = f"{read.get('pe', 0) / 1e6:.1f} / {read.get('de', 0) / 1e6:.1f}" if read else "-"
        busy = r.get("nic_busy", {})
        order = sorted(busy, key=lambda k: (not k.startswith("prefill"), k))
        nics = "/".join(f"{busy[k]:.0%}" for k in order) if busy else "-"
        print(
            f"{name:<14}{r['jct_s']:>9.2f}{r['ttft_p50_s']:>12.3f}{r['ttft_p99_s']:>12.3f}  "
            f"{same:>6}/{args.agents * args.turns:<8}{snic:>20}  {nics:>16}"
        )
    for repeat in range(1, args.repeats + 1):
        tag = "" if args.repeats == 1 else f"#{repeat}"
        for policy in ("dual", "dual+split"):
            if {f"{policy}{tag}", f"pe{tag}"} <= results.keys():
                ratio = results[f"pe{tag}"]["jct_s"] / results[f"{policy}{tag}"]["jct_s"]
                print(f"{policy} vs pe{tag}: {ratio:.2f}x job completion time")
    if args.out:
        Path(args.out).write_text(
            json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "metrics"} for k, v in results.items()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
