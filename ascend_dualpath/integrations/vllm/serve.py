"""``serve``: N prefill (PE) and M decode (DE) ``vllm serve`` instances plus the DualPath proxy, on this machine; or,
with ``--role``, one instance of a deployment whose parts run on several machines (:func:`role_plan`).

The launcher picks free ports (each instance's HTTP port ``p`` and its side channel ``p + 100``), gives every
instance its node, DE group, storage-NIC cap, ``device_id`` (its index: PEs 0..N-1, then DEs) and a share of this
machine's cores (``VLLM_CPU_OMP_THREADS_BIND``: contiguous slices when there are enough cores, else one core each,
round robin), writes the cluster for the proxy (``cluster.json`` in its run directory, the proxy's ``--cluster``
format), writes the deployment's side-channel token (``ADP_SIDE_TOKEN`` when set, else a fresh one) to
``side_token`` of mode 0600 in its run directory, handed to every instance and the proxy, starts the children with working CPU defaults, prints the proxy's URL once every part answers ``/health``
(bounded start-up wait), then serves until a part exits (exit 1) or, under the command line's
:func:`~ascend_dualpath._process.handle_signals`, SIGINT or SIGTERM. Each part's output goes to ``<name>.log`` in
the log directory (``--log-dir``, default :func:`default_log_dir`), which serve prints at start, names again
when it stops and never removes; a part that dies is named with its log's last error line. On the way out it
stops every child (SIGTERM to its process group, a bounded wait, then SIGKILL), removes the block store when
it made a temporary one, its children's temporary directory (:func:`new_run_dir`) and what the emulated
fabric may have left in ``/dev/shm`` (``adp.<fabric>*``) and the shared memory its vLLM instances' CPU workers
leave there (:func:`remove_vllm_shm`); the command then exits with 128 + the signal number (130 / 143) after one line naming the log directory.

Children die with the launcher even when it is killed with SIGKILL, by the rules of
:mod:`ascend_dualpath._process` for programs that are not the library's: each child runs in a process group of
its own with ``PR_SET_PDEATHSIG``, and a group watcher SIGKILLs those groups when the launcher dies (vLLM's
engine-core and worker processes do not follow a killed API server on their own; checked on vLLM 0.32.0 CPU).

With ``--role prefill|decode`` serve starts one ``vllm serve`` instance with the connector, its HTTP API on
``--host:--port`` and its side channel on ``--host:--kv-port``, moving KV over ``--engine mooncake`` (the emulator's
fabric is one host's ``/dev/shm``), reading and writing the shared ``--store``; no proxy (the proxy, on any host, is
told every instance's URL and ``kv=tcp://host:kv-port``). The deployment token comes from ``ADP_SIDE_TOKEN`` or
``--side-token-file``, the same on every host and the proxy; the same lifecycle, logs and clean-up as above.

``ADP_VLLM_SERVE_CMD`` (tests): the command that replaces ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm serve`` server; see :func:`vllm_serve_command`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from ascend_dualpath import _env
from ascend_dualpath._process import (
    Interrupted,
    die_with_parent,
    reap_dead_owners,
    register_child,
    signals_deferred,
    start_group_watcher,
    stop,
)
from ascend_dualpath.dualpath.dataplane import ENGINES, check_engine
from ascend_dualpath.dualpath.side_channel import check_bind, load_token, write_token
from ascend_dualpath.errors import ConfigError, WaitTimeout
from ascend_dualpath.integrations.vllm.cluster import NODE_PREFIX, SIDE_PORT_OFFSET

SHM_DIR = "/dev/shm"
_RANDOM = random.SystemRandom()  # not the random module's: tests seed it, and two serves would pick alike
RUN_PREFIX = "adp-serve-"
MAX_TMP_PATH = 48
# How long vLLM gets to shut its engine core down after SIGTERM.
STOP_GRACE_S = 15.0
# CPU defaults of each instance; the caller's environment wins except for the thread binding.
INSTANCE_ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
LOOPBACK = "127.0.0.1"
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float": 4, "half": 2}


@dataclasses.dataclass(frozen=True)
class InstancePlan:
    """One ``vllm serve`` child: ``name`` (``prefill<i>`` / ``decode<i>``), role, ``device_id`` (unique in the
    deployment), HTTP ``port`` (side channel ``side_port``, None: ``port + 100``), storage ``node``, DE ``group``,
    storage-NIC cap (None: uncapped), thread binding, the vLLM arguments for it alone (after the common ones), and
    the ``host`` address its HTTP API and side channel bind."""

    name: str
    role: str
    device_id: int
    port: int
    node: str
    group: int = 0
    snic_mbps: float | None = None
    bind: str = "0"
    vllm_args: tuple[str, ...] = ()
    host: str = LOOPBACK
    side_port: int | None = None
    tp: int = 1
    dp: int = 1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ranks(self) -> int:
        """Workers of this instance (tensor x data parallel), each with its own side channel at
        :attr:`kv_port` + its index and its own emulated device at :attr:`device_id` + its index."""
        return self.tp * self.dp

    @property
    def kv_port(self) -> int:
        return self.port + SIDE_PORT_OFFSET if self.side_port is None else self.side_port


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """Everything the launcher starts, decided before anything starts.

    ``vllm_args`` go to every ``vllm serve`` command unchanged, after the launcher's own arguments (and before
    an instance's own ``InstancePlan.vllm_args``); ``proxy_args`` go to the proxy. ``token_file``: the
    deployment's side-channel token, handed to every instance and the proxy ("": none). ``engine`` moves the KV
    (``ConnectorSettings.engine``); ``proxy``: whether serve starts the proxy (not with ``--role``).
    """

    model: str
    port: int
    store: str
    block_size: int
    timeout_s: float
    fabric: str
    instances: tuple[InstancePlan, ...]
    vllm_args: tuple[str, ...] = ()
    load_failure_policy: str = "recompute"
    proxy_args: tuple[str, ...] = ()
    token_file: str = ""
    engine: str = "emulator"
    proxy: bool = True


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_port_start() -> int:
    """The lowest port the kernel hands an unbound socket that connects (Linux's ``ip_local_port_range``; 32768,
    its default, where that cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _candidate_port(span: int) -> int:
    """A port to try: drawn below the ephemeral range with room for its side ports above it, where the kernel never
    puts a connecting socket (vLLM's start-up opens many connections; one took a side port drawn from that range);
    the kernel's own pick where the range starts too low for that."""
    top = ephemeral_port_start() - SIDE_PORT_OFFSET - span
    if top > 2048:
        return _RANDOM.randint(max(1024, top - 10_000), top)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_instance_ports(
    count: int, taken: set[int] | frozenset = frozenset(), attempts: int = 200, spans: list[int] | None = None
) -> list[int]:
    """``count`` ports ``p`` with ``p`` and the side ports ``p + 100`` .. ``p + 100 + span - 1`` (``spans``: one
    per instance, its workers; default 1) free on 127.0.0.1 and no clash with ``taken`` or each other (HTTP
    ports and side ports together), below the kernel's ephemeral range (:func:`_candidate_port`). A port is free
    when checked; a race with another program binding it remains possible and shows as a start-up failure naming
    the port."""
    used = set(taken)
    chosen: list[int] = []
    spans = spans or [1] * count
    for _ in range(attempts):
        port = _candidate_port(spans[len(chosen)])
        sides = set(range(port + SIDE_PORT_OFFSET, port + SIDE_PORT_OFFSET + spans[len(chosen)]))
        if max(sides) > 65535 or ({port} | sides) & used or not all(map(_port_is_free, {port} | sides)):
            continue
        chosen.append(port)
        used |= {port} | sides
        if len(chosen) == count:
            return chosen
    raise ConfigError(
        f"found only {len(chosen)} of {count} free port pairs (p, p+{SIDE_PORT_OFFSET}) in {attempts} tries"
    )


def kv_transfer_config(plan: ServePlan, inst: InstancePlan) -> dict:
    """The ``--kv-transfer-config`` of one instance."""
    extra = {
        "store": plan.store,
        "node": inst.node,
        "side_port": inst.kv_port,
        "fabric": plan.fabric,
        "timeout_s": plan.timeout_s,
        "device_id": inst.device_id,
    }
    if inst.host != LOOPBACK:
        extra["side_host"] = inst.host
    if plan.engine != "emulator":
        extra["engine"] = plan.engine
    if inst.snic_mbps is not None:
        extra["snic_mbps"] = inst.snic_mbps
    if plan.token_file:
        extra["side_token_file"] = plan.token_file
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "ascend_dualpath.integrations.vllm.connector",
        "kv_role": KV_ROLES[inst.role],
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": plan.load_failure_policy,
    }


def vllm_serve_command() -> list[str]:
    """``ADP_VLLM_SERVE_CMD`` split like a shell would, else this Python running vLLM's OpenAI API server.

    Not ``vllm serve``: with the ``vllm-cpu`` distribution that CLI dies looking up the version of a
    distribution named ``vllm``; the API server module takes the same arguments, the model as ``--model``.
    """
    override = _env.vllm_serve_cmd()
    if override:
        return shlex.split(override)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def server_argv(model: str, port: int, block_size: int = 32, host: str = LOOPBACK) -> list[str]:
    """One vLLM OpenAI API server of ``model`` on ``host``:``port`` as ``serve`` starts its instances, without a
    connector: with no more arguments it is the plain-vLLM reference the tests and the benchmark compare with."""
    return [
        *vllm_serve_command(), "--model", model,
        "--host", host, "--port", str(port),
        "--enforce-eager", "--block-size", str(block_size),
        # the block store is the cache: vLLM's own prefix cache would serve repeated prefixes from HBM and hide
        # the storage reads DualPath schedules (an --enable-prefix-caching after -- wins)
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def instance_argv(plan: ServePlan, inst: InstancePlan) -> list[str]:
    """The full command line of one ``vllm serve`` child."""
    return [
        *server_argv(plan.model, inst.port, plan.block_size, inst.host),
        "--kv-transfer-config", json.dumps(kv_transfer_config(plan, inst), separators=(",", ":")),
        *plan.vllm_args, *inst.vllm_args,
    ]  # fmt: skip


def cluster_spec(plan: ServePlan) -> dict:
    """The proxy's ``--cluster`` description of the plan's instances."""
    spec: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for inst in plan.instances:
        entry = {"url": inst.url, "node": inst.node}
        if inst.role == "decode":
            entry["group"] = inst.group
        if inst.dp > 1:  # the proxy places on each data-parallel engine (side channel: base + k x tp)
            entry |= {"dp": inst.dp, "tp": inst.tp}
        spec[inst.role].append(entry)
    return spec


def proxy_argv(plan: ServePlan, cluster_file: str) -> list[str]:
    """The proxy child's command line (the side channels follow from the URLs: port + 100)."""
    return [
        sys.executable, "-m", "ascend_dualpath", "proxy", "--cluster", cluster_file,
        "--port", str(plan.port), "--timeout", str(plan.timeout_s), *plan.proxy_args,
        *(("--side-token-file", plan.token_file) if plan.token_file else ()),
    ]  # fmt: skip


def omp_binds(count: int | list[int], cores: list[int]) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of ``count`` instances over ``cores`` (a list: each instance's workers; an
    instance's core lists are joined by "|", vLLM's per-worker separator, data-parallel rank-major).

    With at least as many cores as workers every worker gets a contiguous slice ("0-3"). With fewer, each instance
    keeps its own slice (one core each, round robin, when instances outnumber cores) and its workers share it: a
    vLLM worker waiting for its next step spins on its core (``sched_yield``), and a PE worker sharing a core with a
    DE's worker had its row transfers slowed past the transfer timeout.
    """
    spans = [1] * count if isinstance(count, int) else count
    if sum(spans) <= len(cores):
        workers = _core_slices(sum(spans), cores)
        starts = list(itertools.accumulate(spans, initial=0))
        return ["|".join(workers[a:b]) for a, b in itertools.pairwise(starts)]
    return ["|".join([own] * span) for own, span in zip(_core_slices(len(spans), cores), spans, strict=True)]


def _core_slices(count: int, cores: list[int]) -> list[str]:
    """``count`` contiguous slices of ``cores`` ("0-3"), or one core each, round robin, when there are fewer cores."""
    if count <= len(cores):
        bounds = [(cores[i * len(cores) // count], cores[(i + 1) * len(cores) // count - 1]) for i in range(count)]
        return [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in bounds]
    return [str(cores[i % len(cores)]) for i in range(count)]


PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tp", "-tp": "tp", "--data-parallel-size": "dp", "-dp": "dp",
    "--pipeline-parallel-size": "pp", "-pp": "pp",
}  # fmt: skip


def parallel_sizes(args: Sequence[str], where: str) -> tuple[int, int]:
    """The ``(tensor, data)``-parallel sizes vLLM arguments ``args`` ask for (the last of each flag wins, as in
    vLLM's parser); ConfigError naming ``where`` for a value that is not an int >= 1, or for pipeline parallelism
    (the connector refuses it)."""
    sizes = {"tp": 1, "dp": 1, "pp": 1}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in PARALLEL_FLAGS:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{where}: {flag} {value!r} must be an int >= 1")
        sizes[PARALLEL_FLAGS[flag]] = int(value)
    if sizes["pp"] != 1:
        raise ConfigError(
            f"{where}: --pipeline-parallel-size {sizes['pp']}: the DualPath connector supports 1 (docs/vllm.md)"
        )
    return sizes["tp"], sizes["dp"]


def kv_bytes_per_token(model: str) -> int | None:
    """KV bytes of one token over all layers from the model's ``config.json`` (K and V, its ``torch_dtype``);
    None when the config lacks a field. The proxy derives alpha from it and the storage-NIC caps."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        dtype = DTYPE_BYTES[str(config.get("torch_dtype") or config.get("dtype") or "float32")]
        return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def child_env(bind: str | None, base: dict[str, str] | None = None, tmp: str | None = None) -> dict[str, str]:
    """Environment of a child: CPU defaults under the caller's environment, an instance's thread binding
    (``bind``; None for the proxy), its ``TMPDIR`` (``tmp``: serve's run directory) and this package first on
    ``PYTHONPATH`` (every child runs the launcher's own copy of the connector)."""
    env = {**INSTANCE_ENV_DEFAULTS, **(os.environ if base is None else base)}
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if tmp is not None:
        env["TMPDIR"] = tmp
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH", "")) if p)
    return env


# A line that names what went wrong: an exception's last line, or a log record at ERROR / CRITICAL.
ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt)\b|\b(ERROR|CRITICAL|FATAL)\b")
LOG_SCAN_BYTES = 1 << 20


@dataclasses.dataclass
class Child:
    """One started child: its name, URL it answers ``/health`` on, process and log file."""

    name: str
    health_url: str
    process: subprocess.Popen
    log_path: str

    def last_error_line(self) -> str:
        """The last line of the log that names an error (the end of a traceback, an ERROR record), with the one
        before it when it only points there ("see root cause above", as vLLM's engine start-up says); else the
        log's last line. Reads at most the log's last MiB."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.path.getsize(self.log_path) - LOG_SCAN_BYTES))
                lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError as exc:
            return f"(log unreadable: {exc})"
        if not lines:
            return "(its log is empty)"
        errors = [line for line in lines if ERROR_LINE.search(line)]
        if not errors:
            return lines[-1]
        if "above" in errors[-1].lower():
            cause = next((line for line in reversed(errors) if "above" not in line.lower()), None)
            if cause is not None:
                return f"{cause} (then: {errors[-1]})"
        return errors[-1]

    def ended(self, code: int, when: str) -> str:
        """One line: which child exited with what ``when``, its last error line and where its log is."""
        return f"{self.name} exited with {code} {when}; last error line: {self.last_error_line()} (log {self.log_path})"


def start_child(name: str, argv: list[str], env: dict[str, str], health_url: str, log_dir: str) -> Child:
    """Start ``argv`` in its own process group, output appended to ``<log_dir>/<name>.log`` after a line naming
    this start, dying with this process."""
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "ab") as log:
        log.write(f"=== serve (pid {os.getpid()}) starts {name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                  f"{shlex.join(argv)}\n".encode())  # fmt: skip
        log.flush()
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    register_child(process, group=True)  # an interrupt that comes before serve's own clean-up still stops it
    return Child(name, health_url, process, log_path)


def answers_health(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_healthy(children: list[Child], timeout_s: float) -> None:
    """Poll every child's ``/health`` until all answer 200.

    Raises :class:`WaitTimeout` naming the parts that did not come up within ``timeout_s`` (with their last
    error lines and logs), or ``RuntimeError`` naming a part that exited first.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(child.ended(code, "during start-up"))
            if answers_health(child.health_url):
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            lines = "; ".join(f"{c.name}: {c.last_error_line()} (log {c.log_path})" for c in pending)
            raise WaitTimeout(f"{len(pending)} part(s) did not answer /health within {timeout_s} s: {lines}")
        if pending:
            time.sleep(0.5)


def remove_fabric_shm(fabric: str, shm_dir: str = SHM_DIR) -> int:
    """Unlink ``<shm_dir>/adp.<fabric>*`` (left by children that were killed); returns how many went."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            if name.startswith(f"adp.{fabric}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, name))
                    removed += 1
    return removed


VLLM_DIST_PREFIX = "vllm_dist_"  # vLLM's init file in its TMPDIR, and its CPU workers' shared memory's names


def vllm_dist_idents(run_dir: str) -> list[str]:
    """The identities of the vLLM instances whose ``TMPDIR`` is ``run_dir`` (serve's children): vLLM initialises a
    worker group through the file ``<TMPDIR>/vllm_dist_<uuid>``, and its CPU workers of tensor-parallel size above 1
    name their shared memory after it (``/dev/shm/vllm_dist_<uuid>-...-cpushm_<rank>``), never removing it."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(name for name in os.listdir(run_dir) if name.startswith(VLLM_DIST_PREFIX))
    return []


def remove_vllm_shm(idents: list[str], shm_dir: str = SHM_DIR) -> int:
    """Unlink ``<shm_dir>/<ident>-*`` of each of ``idents`` (:func:`vllm_dist_idents`, once the instances stopped);
    returns how many went. Another vLLM's shared memory (another identity) stays."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            if any(name.startswith(f"{ident}-") for ident in idents):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, name))
                    removed += 1
    return removed


@dataclasses.dataclass
class ServeOptions:
    """What ``python -m ascend_dualpath serve`` was asked for (see ``ascend_dualpath.cli.serve``).

    ``nodes``: one node name per instance (PEs then DEs; default: each its own, ``pe<i>`` / ``de<i>``);
    ``decode_groups``: one group per DE (default 0); ``node_snic_mbps``: a storage-NIC cap per node name (each
    instance on it gets that cap; others get ``snic_mbps``); ``instance_args``: vLLM arguments for one instance
    by name (``decode1``), after the common ``vllm_args``; ``layout``: a JSON file with the same per-instance
    facts (see :func:`load_layout`), which then also gives the counts; ``log_dir``: where every part's log goes
    (default :func:`default_log_dir`); ``engine``: what moves the KV (``emulator``, ``mooncake``, ``cuda``).

    ``role`` (``prefill`` / ``decode``): one instance of a multi-host deployment (module docstring): ``port`` is
    its HTTP port, ``host`` the address it binds and publishes, ``kv_port`` its side channel, ``node`` its storage
    NIC's name (default ``pe0`` / ``de0``), ``side_token_file`` the deployment token (else ``ADP_SIDE_TOKEN``).
    """

    model: str
    port: int = 8000
    policy: str = "dual"
    store: str | None = None
    snic_mbps: float | None = None
    block_size: int = 32
    timeout_s: float = dataclasses.field(default_factory=_env.timeout_s)
    startup_timeout_s: float = 300.0
    vllm_args: tuple[str, ...] = ()
    load_failure_policy: str = "recompute"
    prefill: int = 1
    decode: int = 1
    nodes: tuple[str, ...] = ()
    decode_groups: tuple[int, ...] = ()
    node_snic_mbps: dict[str, float] = dataclasses.field(default_factory=dict)
    instance_args: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    layout: str | None = None
    placement: str = "scheduler"
    split: bool = False
    alpha_tokens: int | None = None
    beta_tokens: int | None = None
    compute_quota_s: float = 0.0
    log_dir: str | None = None
    engine: str = "emulator"
    role: str | None = None
    host: str = LOOPBACK
    kv_port: int | None = None
    node: str | None = None
    side_token_file: str | None = None

    def validate(self) -> None:
        check_engine(self.engine, "--engine")
        if self.role is not None:
            self._validate_role()
        if not os.path.isdir(self.model):
            raise ConfigError(f"--model {self.model!r} is not a directory (make one with make-tiny-model)")
        if self.block_size <= 0 or self.block_size % 32:
            raise ConfigError(f"--block-size {self.block_size} must be a positive multiple of 32 (vLLM CPU attention)")
        caps = {"--snic-mbps": self.snic_mbps, **{f"--node-snic-mbps {n}": v for n, v in self.node_snic_mbps.items()}}
        for flag, cap in caps.items():
            if cap is not None and not cap > 0:
                raise ConfigError(f"{flag} {cap} must be > 0")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.prefill < 1 or self.decode < 1:
            raise ConfigError(f"--prefill {self.prefill} and --decode {self.decode} must both be >= 1")

    # the options of a whole deployment on this machine, which --role (one instance) does not take
    DEPLOYMENT_ONLY = {
        "--prefill": ("prefill", 1), "--decode": ("decode", 1), "--nodes": ("nodes", ()),
        "--decode-groups": ("decode_groups", ()), "--node-snic-mbps": ("node_snic_mbps", {}),
        "--instance-args": ("instance_args", {}), "--layout": ("layout", None), "--split": ("split", False),
        "--placement": ("placement", "scheduler"), "--policy": ("policy", "dual"), "--alpha-tokens": ("alpha_tokens", None),
        "--beta-tokens": ("beta_tokens", None), "--compute-quota": ("compute_quota_s", 0.0),
    }  # fmt: skip

    def _validate_role(self) -> None:
        """One instance of a multi-host deployment: ConfigError naming the first bad value, before any work."""
        if self.role not in KV_ROLES:
            raise ConfigError(f"--role {self.role!r} must be one of {', '.join(KV_ROLES)}")
        given = [flag for flag, (name, default) in self.DEPLOYMENT_ONLY.items() if getattr(self, name) != default]
        if given:
            raise ConfigError(f"--role starts one instance: {', '.join(given)} belong to a deployment on one machine "
                              "(give the proxy its own options)")  # fmt: skip
        if self.engine != "mooncake":
            raise ConfigError(f"--role needs --engine mooncake: {self.engine!r} moves KV only inside one host "
                              f"(engines: {', '.join(ENGINES)})")  # fmt: skip
        if self.kv_port is None or not 0 < self.kv_port < 65536 or self.kv_port == self.port:
            raise ConfigError(f"--kv-port {self.kv_port} must be a TCP port other than --port {self.port}")
        if not self.store or not os.path.isdir(self.store):
            raise ConfigError(f"--store {self.store!r} must be an existing directory (the store every host mounts)")
        if self.node is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.node):
            raise ConfigError(f"--node {self.node!r} must be 1 to 64 letters, digits, '_', '.' or '-'")
        token = load_token(self.side_token_file, "--side-token-file")
        check_bind(self.host, None, token, {"side_host": "--host", "side_token_file": "--side-token-file"}.get)
        if self.host == "0.0.0.0":
            raise ConfigError("--host '0.0.0.0': give the address the other hosts reach this one at")


LAYOUT_KEYS = {"prefill": {"node", "snic_mbps", "vllm_args"}, "decode": {"node", "group", "snic_mbps", "vllm_args"}}


def load_layout(path: str) -> list[dict]:
    """Per-instance facts from a JSON file ``{"prefill": [{"node", "snic_mbps", "vllm_args"}...], "decode":
    [{"node", "group", "snic_mbps", "vllm_args"}...]}`` (every key optional; the proxy's ``--cluster`` format
    without URLs, plus a cap and vLLM arguments per instance), as :func:`instance_layout` returns them."""
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--layout {path!r}: cannot read a JSON layout: {exc}") from None
    if not isinstance(spec, dict) or set(spec) - set(LAYOUT_KEYS):
        raise ConfigError(f"--layout {path!r}: expected an object with keys {sorted(LAYOUT_KEYS)}")
    out = []
    for role in ("prefill", "decode"):
        for index, entry in enumerate(spec.get(role) or []):
            if not isinstance(entry, dict) or set(entry) - LAYOUT_KEYS[role]:
                raise ConfigError(f"--layout {path!r}: {role}[{index}] = {entry!r} may have only {LAYOUT_KEYS[role]}")
            out.append(_layout_entry(role, index, entry.get("node"), entry.get("group", 0), entry.get("snic_mbps"),
                                     tuple(entry.get("vllm_args") or ())))  # fmt: skip
    return out


def _layout_entry(role: str, index: int, node, group, snic, vllm_args: tuple[str, ...]) -> dict:
    if not isinstance(group, int) or group < 0:
        raise ConfigError(f"{role}{index}: decode group {group!r} must be an int >= 0")
    if snic is not None and not (isinstance(snic, int | float) and snic > 0):
        raise ConfigError(f"{role}{index}: snic_mbps {snic!r} must be > 0")
    node = str(node or f"{NODE_PREFIX[role]}{index}")
    return {"name": f"{role}{index}", "role": role, "node": node, "group": group, "snic_mbps": snic,
            "vllm_args": vllm_args}  # fmt: skip


def _flag_layout(opts: ServeOptions) -> list[dict]:
    """The layout of ``--prefill`` / ``--decode`` / ``--nodes`` / ``--decode-groups``."""
    count = opts.prefill + opts.decode
    if opts.nodes and len(opts.nodes) != count:
        raise ConfigError(f"--nodes names {len(opts.nodes)} nodes for {count} instances (PEs then DEs)")
    if opts.decode_groups and len(opts.decode_groups) != opts.decode:
        raise ConfigError(f"--decode-groups names {len(opts.decode_groups)} groups for {opts.decode} DEs")
    nodes = opts.nodes or (None,) * count
    groups = opts.decode_groups or (0,) * opts.decode
    roles = [("prefill", i, 0) for i in range(opts.prefill)] + [("decode", i, groups[i]) for i in range(opts.decode)]
    return [_layout_entry(role, i, nodes[k], group, None, ()) for k, (role, i, group) in enumerate(roles)]


def instance_layout(opts: ServeOptions) -> list[dict]:
    """Every instance's name, role, node, group, cap and own vLLM arguments, PEs first (see ServeOptions)."""
    if opts.layout and (opts.nodes or opts.decode_groups):
        raise ConfigError("--layout gives the nodes and groups: leave out --nodes / --decode-groups")
    entries = load_layout(opts.layout) if opts.layout else _flag_layout(opts)
    names = {e["name"] for e in entries}
    unknown = sorted(set(opts.instance_args) - names)
    if unknown or {e["role"] for e in entries} != {"prefill", "decode"}:
        raise ConfigError(f"instances {sorted(names)}: need a PE and a DE; --instance-args names unknown {unknown}")
    for entry in entries:
        entry["vllm_args"] += tuple(opts.instance_args.get(entry["name"], ()))
        entry["tp"], entry["dp"] = parallel_sizes((*opts.vllm_args, *entry["vllm_args"]), entry["name"])
        if entry["snic_mbps"] is None:
            entry["snic_mbps"] = opts.node_snic_mbps.get(entry["node"], opts.snic_mbps)
    return entries


def proxy_options(opts: ServeOptions, model: str) -> tuple[str, ...]:
    """The proxy's placement arguments (the thresholds it measures itself when not given)."""
    args = ["--placement", opts.placement, "--policy", opts.policy, "--startup-timeout", str(opts.startup_timeout_s)]
    for flag, value in (("--alpha-tokens", opts.alpha_tokens), ("--beta-tokens", opts.beta_tokens),
                        ("--kv-bytes-per-token", kv_bytes_per_token(model))):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    if opts.compute_quota_s:
        args += ["--compute-quota", str(opts.compute_quota_s)]
    return (*args, "--split") if opts.split else tuple(args)


def make_plan(opts: ServeOptions, store: str, cores: list[int] | None = None, token_file: str = "") -> ServePlan:
    """Ports, device ids, thread bindings and a fresh fabric name for one deployment (the proxy's port is kept out
    of the picks); ``cores``: the cores to spread the instances over (default: this process's affinity);
    ``token_file``: the deployment's side-channel token (:attr:`ServePlan.token_file`)."""
    layout = instance_layout(opts)
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    spans = [e["tp"] * e["dp"] for e in layout]
    ports = pick_instance_ports(len(layout), taken={opts.port}, spans=spans)
    binds = omp_binds(spans, cores)
    devices = list(itertools.accumulate(spans[:-1], initial=0))  # each worker its own emulated device
    instances = tuple(
        InstancePlan(e["name"], e["role"], device_id, port, e["node"], e["group"], e["snic_mbps"], bind, e["vllm_args"],
                     tp=e["tp"], dp=e["dp"])
        for device_id, e, port, bind in zip(devices, layout, ports, binds, strict=True)
    )  # fmt: skip
    model = os.path.abspath(opts.model)
    return ServePlan(
        model=model, port=opts.port, store=store, block_size=opts.block_size, timeout_s=opts.timeout_s,
        fabric=f"serve{os.getpid()}x{secrets.token_hex(4)}", instances=instances, vllm_args=tuple(opts.vllm_args),
        load_failure_policy=opts.load_failure_policy, proxy_args=proxy_options(opts, model), token_file=token_file,
        engine=opts.engine,
    )  # fmt: skip


def role_plan(opts: ServeOptions, token_file: str = "") -> ServePlan:
    """The plan of one instance (``opts.role``) of a multi-host deployment: no proxy, every core of this process."""
    cores = sorted(os.sched_getaffinity(0))
    tp, dp = parallel_sizes(opts.vllm_args, f"{opts.role}0")
    inst = InstancePlan(
        f"{opts.role}0", opts.role, 0 if opts.role == "prefill" else 1, opts.port,
        opts.node or f"{NODE_PREFIX[opts.role]}0", snic_mbps=opts.snic_mbps, bind=omp_binds([tp * dp], cores)[0],
        host=opts.host, side_port=opts.kv_port, tp=tp, dp=dp,
    )  # fmt: skip
    return ServePlan(
        model=os.path.abspath(opts.model), port=opts.port, store=os.path.abspath(str(opts.store)),
        block_size=opts.block_size, timeout_s=opts.timeout_s, fabric=f"serve{os.getpid()}x{secrets.token_hex(4)}",
        instances=(inst,), vllm_args=tuple(opts.vllm_args), load_failure_policy=opts.load_failure_policy,
        token_file=token_file, engine=opts.engine, proxy=False,
    )  # fmt: skip


def ready_line(plan: ServePlan, store: str) -> str:
    """What serve prints once every part answers ``/health``."""
    if not plan.proxy:
        inst = plan.instances[0]
        return (f"serve: ready at {inst.url}/v1 ({inst.name}, side channel tcp://{inst.host}:{inst.kv_port}, node "
                f"{inst.node}, engine {plan.engine}; store {store})")  # fmt: skip
    parts = ", ".join(f"{i.name} :{i.port} node {i.node}" for i in plan.instances)
    return (
        f"serve: ready at http://127.0.0.1:{plan.port}/v1 ({parts}; proxy {' '.join(plan.proxy_args)}; store {store})"
    )


def start_all(plan: ServePlan, log_dir: str, run_dir: str) -> list[Child]:
    """Start every instance, then the proxy with the cluster written to ``<log_dir>/cluster.json`` (all come up
    concurrently); every child's temporary files go to ``run_dir``."""
    children = []
    for inst in plan.instances:
        env = child_env(inst.bind, tmp=run_dir) | ({"VLLM_HOST_IP": inst.host} if inst.host != LOOPBACK else {})
        children.append(start_child(inst.name, instance_argv(plan, inst), env, f"{inst.url}/health", log_dir))
    if not plan.proxy:
        return children
    cluster_file = os.path.join(log_dir, "cluster.json")
    with open(cluster_file, "w") as f:
        json.dump(cluster_spec(plan), f)
    children.append(start_child("proxy", proxy_argv(plan, cluster_file), child_env(None, tmp=run_dir),
                                f"http://127.0.0.1:{plan.port}/health", log_dir))  # fmt: skip
    return children


def _short_tmp() -> str:
    """The temporary directory, or ``/tmp`` when its path is too long for the Unix sockets vLLM makes there (at
    most 107 bytes, of which a socket's own name takes about 45)."""
    tmp = tempfile.gettempdir()
    return tmp if len(tmp) <= MAX_TMP_PATH else "/tmp"


def new_run_dir() -> str:
    """``<tmp>/adp-serve-<pid>-XXXX``: the children's ``TMPDIR`` (vLLM's IPC sockets, torch's compile caches) and
    a temporary store, removed at exit; those of serves that died (SIGKILL) are removed first, with the shared
    memory their vLLM instances left (:func:`remove_vllm_shm`)."""
    reap_dead_owners(_short_tmp(), RUN_PREFIX, "-", before=lambda path: remove_vllm_shm(vllm_dist_idents(path)))
    return tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=_short_tmp())


def _serve_until_a_child_exits(children: list[Child]) -> None:
    """Sleep until a child exits (SIGINT / SIGTERM end it sooner, as :class:`Interrupted`); says which."""
    while True:
        for child in children:
            code = child.process.poll()
            if code is not None:
                print(f"serve: {child.ended(code, 'while serving')}; stopping", file=sys.stderr, flush=True)
                return
        time.sleep(0.5)


def default_log_dir(now: float | None = None) -> str:
    """``$XDG_STATE_HOME/ascend_dualpath/serve/<YYYYmmdd-HHMMSS>-<pid>`` (``~/.local/state`` without
    ``XDG_STATE_HOME``): one new directory per run, outside the temporary directory, never removed by serve."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return os.path.join(state, "ascend_dualpath", "serve", f"{stamp}-{os.getpid()}")


def serve(opts: ServeOptions) -> int:
    """Run one deployment until a part exits (returns 1) or SIGINT / SIGTERM (:class:`Interrupted`, with what
    was stopped, removed and kept in its ``details``, under :func:`~ascend_dualpath._process.handle_signals`).

    Every part's output goes to ``<log dir>/<name>.log`` (and the proxy's cluster to ``cluster.json`` there);
    the log directory is printed to stderr first and named again on every way out, and is never removed.
    """
    opts.validate()
    if opts.role is None:
        instance_layout(opts)  # its errors before anything exists to clean up
    log_dir = os.path.abspath(opts.log_dir or default_log_dir())
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--log-dir {log_dir!r}: cannot create it ({exc.strerror})") from None
    print(f"serve: logs in {log_dir} (one file per part, kept after exit)", file=sys.stderr, flush=True)
    run_dir = new_run_dir()
    store = opts.store or os.path.join(run_dir, "store")
    os.makedirs(store, exist_ok=True)
    if opts.role is not None:  # the token every host shares: the given file, else ADP_SIDE_TOKEN (inherited)
        plan = role_plan(opts, opts.side_token_file or "")
    else:
        # one token per deployment (ADP_SIDE_TOKEN when set, so the operator can ask the side channels too), so
        # no other process of this machine can talk to its side channels; removed with the run directory
        token_file = os.path.join(run_dir, "side_token")
        write_token(token_file, load_token(None))
        plan = make_plan(opts, store, token_file=token_file)
    children: list[Child] = []
    watcher = None
    try:
        children = start_all(plan, log_dir, run_dir)
        watcher = start_group_watcher([c.process.pid for c in children])
        wait_until_healthy(children, opts.startup_timeout_s)
        print(ready_line(plan, store), flush=True)
        _serve_until_a_child_exits(children)
    except (WaitTimeout, RuntimeError, OSError) as exc:
        print(f"serve: {exc}", file=sys.stderr, flush=True)
    except Interrupted as interrupted:  # handle_signals prints the one line, with these details
        kept = f"store kept at {store}" if opts.store else "temporary store removed"
        interrupted.details += [f"{len(children)} children stopped", kept, f"logs kept in {log_dir}"]
        raise
    finally:
        with signals_deferred():  # a second signal must not cut the clean-up short
            idents = vllm_dist_idents(run_dir)  # while the instances run (the init file may go as they stop)
            stop([(c.process, True) for c in children], grace_s=STOP_GRACE_S)
            if watcher is not None:
                stop([(watcher, True)])
            remove_fabric_shm(plan.fabric)
            remove_vllm_shm(idents)
            shutil.rmtree(run_dir, ignore_errors=True)  # the children's temporary files and a temporary store
    kept = f"store kept at {store}" if opts.store else "temporary store removed"
    print(f"serve: stopped after a failure; {len(children)} children stopped, {kept}; logs kept in {log_dir}",
          file=sys.stderr, flush=True)  # fmt: skip
    return 1
