"""Two hosts in CI: a PE and a DE on two "machines", KV over the Mooncake Transfer Engine, against plain vLLM.

Two network namespaces joined by a veth pair (:class:`~ascend_dualpath.bench.netns.Hosts`) are the two hosts: the PE
(``serve --role prefill --engine mooncake``) and the proxy in one, the DE (``serve --role decode``) in the other,
the block store a directory both see (the shared mount). Multi-turn conversations through the proxy with
``--policy dual``, ``pe`` and ``de``: every turn's greedy text equals a plain vLLM server's (the reference of
test_serve_e2e.py, in this machine's own namespace), later turns load their prefix from storage (bytes per storage
NIC in the proxy's ``/metrics``), and no instance maps anything of the library in ``/dev/shm``. Then the DE is
killed while it streams: the request ends with an error within the bound. The namespaces and every process go
whatever happens (``finally`` and ``atexit``). Root only; slow (three vLLM servers start).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascend_dualpath.bench.netns import Hosts, unavailable

pytest.importorskip("vllm")
pytest.importorskip(
    "mooncake.engine",
    reason="the Mooncake Transfer Engine is optional: pip install 'ascend_dualpath[mooncake]' (docs/mooncake.md)",
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=f"two hosts on one machine: {unavailable()}"),
]

from ascend_dualpath.integrations.vllm.serve import kv_bytes_per_token, pick_instance_ports  # noqa: E402
from tests.integrations.vllm import test_serve_e2e  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import (  # noqa: E402
    ENV,
    ROOT,
    STARTUP_S,
    TURNS,
    _complete,
    _conversation,
    _get,
    _metric,
    _stop,
    _stream_killing,
    _term_with_pytest,
    _vocab,
    _wait_http,
)

model, plain = test_serve_e2e.model, test_serve_e2e.plain  # its fixtures: the tiny model and the plain vLLM server

CALL_S = 300.0  # one request, or a start-up wait, inside a namespace
NODES = ("pe0", "de0")


@dataclasses.dataclass
class TwoHosts:
    hosts: Hosts
    model: str
    env: dict
    ports: list[int]  # HTTP port of the PE and the DE; side channels at + 1
    servers: list[subprocess.Popen]
    logs: Path
    started: list[subprocess.Popen]

    def url(self, side: int) -> str:
        return f"http://{self.hosts.addrs[side]}:{self.ports[side]}"

    def start(self, side: int, name: str, argv: list[str]) -> subprocess.Popen:
        """``argv`` inside namespace ``side``, in its own group, SIGTERMed when pytest dies, output to a log."""
        proc = subprocess.Popen(
            self.hosts.command(side, argv),
            env=self.env,
            stdout=(self.logs / f"{name}.out").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_term_with_pytest,
            cwd=ROOT,
        )
        self.started.append(proc)
        return proc

    def wait_http(self, side: int, url: str, proc: subprocess.Popen, name: str) -> None:
        self.hosts.call(side, lambda: _wait_http(url, proc, self.logs / f"{name}.out"), STARTUP_S + 30)

    def server_pid(self, side: int) -> int:
        """The vLLM server answering on this side's HTTP port (found inside its namespace)."""
        out = subprocess.check_output(
            self.hosts.command(side, ["fuser", "-n", "tcp", str(self.ports[side])]), stderr=subprocess.DEVNULL
        )
        return int(out.split()[0])

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            _stop(proc)
        self.started.clear()
        self.hosts.close()


@pytest.fixture(scope="module")
def two_hosts(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-hosts")
    (tmp / "store").mkdir()
    env = {**os.environ, **ENV, "ADP_SIDE_TOKEN": secrets.token_hex(32), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    hosts = Hosts("adp-2h")
    ports = pick_instance_ports(2)  # the namespaces are new: free there too (side channels at + 1)
    d = TwoHosts(hosts, model, env, ports, [], tmp, [])
    atexit.register(d.stop_all)  # pytest itself interrupted: the namespaces still go
    try:
        hosts.__enter__()
        for side, role in enumerate(("prefill", "decode")):
            argv = [
                sys.executable, "-m", "ascend_dualpath", "serve", "--role", role, "--engine", "mooncake",
                "--model", model, "--host", hosts.addrs[side], "--port", str(ports[side]),
                "--kv-port", str(ports[side] + 1), "--store", str(tmp / "store"), "--node", NODES[side],
                "--timeout", "20", "--log-dir", str(tmp / f"logs-{role}"),
            ]  # fmt: skip
            d.servers.append(d.start(side, role, argv))
        for side, role in enumerate(("prefill", "decode")):
            d.wait_http(side, f"{d.url(side)}/health", d.servers[side], role)
        yield d
    finally:
        d.stop_all()
        atexit.unregister(d.stop_all)


def _proxy(d: TwoHosts, policy: str) -> tuple[subprocess.Popen, str]:
    """The proxy beside the PE (namespace 0), told both instances by address; its URL once it answers."""
    port = d.hosts.call(0, lambda: pick_instance_ports(1)[0], CALL_S)  # free where the proxy runs: beside the PE
    a = d.hosts.addrs
    argv = [
        sys.executable, "-m", "ascend_dualpath", "proxy", "--port", str(port), "--policy", policy, "--timeout", "20",
        "--prefill", f"{d.url(0)},node={NODES[0]},kv=tcp://{a[0]}:{d.ports[0] + 1}",
        "--decode", f"{d.url(1)},node={NODES[1]},kv=tcp://{a[1]}:{d.ports[1] + 1}",
        "--kv-bytes-per-token", str(kv_bytes_per_token(d.model)),
    ]  # fmt: skip
    proc = d.start(0, f"proxy-{policy}", argv)
    url = f"http://127.0.0.1:{port}"
    d.wait_http(0, f"{url}/health", proc, f"proxy-{policy}")
    return proc, url


def _reads(d: TwoHosts, url: str) -> dict[str, float]:
    """Bytes read per storage NIC, loads (every path) and failed loads so far, from the proxy's ``/metrics``."""
    metrics = d.hosts.call(0, lambda: _get(f"{url}/metrics"), CALL_S)
    loads = sum(_metric(metrics, "vllm:dualpath_loads_total", path=p) for p in ("pe", "de", "split"))
    failures = _metric(metrics, "vllm:dualpath_failures_total")
    return {"loads": loads, "failures": failures} | {n: _metric(metrics, "adp_snic_read_bytes", node=n) for n in NODES}


def _library_shm(pid: int) -> list[str]:
    """What process ``pid`` maps of the library's shared memory (the emulated fabric's ``/dev/shm/adp.*``)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/dev/shm/adp." in line})


@pytest.mark.parametrize("policy", ["dual", "pe", "de"])
def test_two_hosts_match_plain_vllm_and_load_from_storage(two_hosts, model, plain, policy):
    d = two_hosts
    proxy, url = _proxy(d, policy)
    try:
        before = _reads(d, url)
        agent = {"dual": 0, "pe": 1, "de": 2}[policy]  # fresh conversations: their first turn misses the store
        prompt = ""
        for turn, append in enumerate(_conversation(model, agent)):
            prompt = f"{prompt} {append}".strip()
            ours = d.hosts.call(0, lambda p=prompt, s=(turn == 1): _complete(url, model, p, stream=s), CALL_S)
            reference = _complete(plain, model, prompt)
            assert ours == reference, f"{policy} turn {turn}: {ours!r} != plain vLLM's {reference!r}"
            prompt += ours
        after = _reads(d, url)
        read = {key: after[key] - before[key] for key in after}
        assert read["loads"] >= TURNS - 1 and read["pe0"] + read["de0"] > 0, read  # every later turn loaded
        assert read["failures"] == 0, read
        if policy == "pe":
            assert read["de0"] == 0 < read["pe0"], read
        if policy == "de":
            assert read["pe0"] == 0 < read["de0"], read
        for side in (0, 1):
            assert _library_shm(d.server_pid(side)) == [], f"side {side} maps the library's /dev/shm"
    finally:
        _stop(proxy)
    for server in d.servers:
        assert server.poll() is None, "an instance exited"


def test_killing_the_other_hosts_de_ends_the_request_in_flight_with_an_error(two_hosts, model):
    d = two_hosts
    proxy, url = _proxy(d, "pe")
    try:
        pid = d.server_pid(1)
        words = _vocab(model)
        prompt = " ".join(words[(7 * i) % len(words)] for i in range(600))
        body = {"model": model, "prompt": prompt, "max_tokens": 2500, "temperature": 0, "ignore_eos": True}
        started = time.monotonic()
        events = d.hosts.call(
            0, lambda: _stream_killing(f"{url}/v1/completions", {**body, "stream": True}, pid), CALL_S
        )
        assert "[DONE]" not in events, f"the stream survived the decode's death: {events[-3:]}"
        error = json.loads(events[-1])["error"]
        assert error["code"] == 502, error
        assert time.monotonic() - started < 60
        assert d.servers[1].wait(60) == 1  # its serve saw its instance die and stopped
        assert d.servers[0].poll() is None  # the PE's host is untouched
    finally:
        _stop(proxy)
