"""The serve launcher's pure parts, and its life cycle with a fake ``vllm serve`` (ADP_VLLM_SERVE_CMD).

The fake answers ``/health`` on its ``--port``, records its argv, pid and a ``sleep`` grandchild's pid in a
directory, and leaves a file in /dev/shm named after its fabric, so the tests can check that serve leaves
nothing behind. The proxy child is the real one (it needs no model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ascend_dualpath._process import stop  # noqa: E402
from ascend_dualpath.errors import ConfigError  # noqa: E402
from ascend_dualpath.integrations.vllm import serve as serve_mod  # noqa: E402
from ascend_dualpath.integrations.vllm.serve import InstancePlan, ServeOptions, ServePlan  # noqa: E402

FAKE_VLLM = r"""
import http.server, json, os, signal, subprocess, sys

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
fabric = config["kv_connector_extra_config"]["fabric"]
out = os.environ["FAKE_VLLM_DIR"]
# Like vLLM's engine core, the grandchild does not follow its parent's death on its own.
grandchild = subprocess.Popen(["sleep", "600"])
open(f"/dev/shm/adp.{fabric}.fake{port}", "w").close()
with open(os.path.join(out, f"{port}.json"), "w") as f:
    json.dump({"argv": argv, "pid": os.getpid(), "grandchild": grandchild.pid,
               "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "host_ip": os.environ.get("VLLM_HOST_IP"),
               "offline": os.environ.get("HF_HUB_OFFLINE"), "tmpdir": os.environ.get("TMPDIR"),
               "token_mode": os.stat(token).st_mode & 0o777
               if (token := config["kv_connector_extra_config"].get("side_token_file")) else None}, f)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

if os.environ.get("FAKE_VLLM_FAIL") == str(config["kv_connector_extra_config"]["device_id"]):
    print("INFO starting", flush=True)
    print("Traceback (most recent call last):\nValueError: fake vllm cannot start\nINFO shutting down", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


PE = InstancePlan("prefill0", "prefill", 0, 41000, "pe0", bind="0")
DE = InstancePlan("decode0", "decode", 1, 42000, "de0", bind="1")


def plan(**overrides) -> ServePlan:
    fields = dict(model="/m", port=8000, store="/s", block_size=32, timeout_s=12.0, fabric="servefab",
                  instances=(PE, DE))  # fmt: skip
    return ServePlan(**{**fields, **overrides})


def test_kv_transfer_config_per_instance():
    pe = serve_mod.kv_transfer_config(plan(), dataclasses.replace(PE, snic_mbps=250.0))
    assert pe == {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "ascend_dualpath.integrations.vllm.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"store": "/s", "node": "pe0", "side_port": 41100, "fabric": "servefab",
                                      "timeout_s": 12.0, "device_id": 0, "snic_mbps": 250.0},
        "kv_load_failure_policy": "recompute",
    }  # fmt: skip
    de = serve_mod.kv_transfer_config(plan(), DE)
    assert de["kv_role"] == "kv_consumer" and de["kv_connector_extra_config"]["side_port"] == 42100
    assert de["kv_connector_extra_config"]["device_id"] == 1
    assert "snic_mbps" not in de["kv_connector_extra_config"]  # uncapped: left out
    assert "side_token_file" not in de["kv_connector_extra_config"]


def test_the_deployment_token_file_goes_to_every_instance_and_the_proxy():
    tokened = plan(token_file="/run/adp/side_token")
    for inst in (PE, DE):
        assert serve_mod.kv_transfer_config(tokened, inst)["kv_connector_extra_config"]["side_token_file"] == (
            "/run/adp/side_token"
        )
    argv = serve_mod.proxy_argv(tokened, "/c.json")
    assert argv[argv.index("--side-token-file") + 1] == "/run/adp/side_token"
    assert "--side-token-file" not in serve_mod.proxy_argv(plan(), "/c.json")


def test_instance_argv_puts_extra_args_last_and_unchanged(monkeypatch):
    monkeypatch.delenv("ADP_VLLM_SERVE_CMD", raising=False)
    extra = ("--max-model-len", "512", "--served-model-name", "a b")
    own = ("--num-gpu-blocks-override", "8")
    argv = serve_mod.instance_argv(plan(vllm_args=extra), dataclasses.replace(DE, vllm_args=own))
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert argv[argv.index("--port") + 1] == "42000" and argv[argv.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in argv and tuple(argv[-6:]) == extra + own
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    monkeypatch.setenv("ADP_VLLM_SERVE_CMD", "fake-vllm --flag")
    assert serve_mod.instance_argv(plan(), PE)[:4] == ["fake-vllm", "--flag", "--model", "/m"]


def test_proxy_argv_and_cluster_spec_name_every_instance():
    argv = serve_mod.proxy_argv(plan(proxy_args=("--policy", "de", "--split")), "/run/cluster.json")
    assert argv[:4] == [sys.executable, "-m", "ascend_dualpath", "proxy"] and argv[-1] == "--split"
    values = dict(zip(argv[4:-1:2], argv[5:-1:2], strict=True))
    assert values == {"--cluster": "/run/cluster.json", "--port": "8000", "--timeout": "12.0", "--policy": "de"}
    de1 = InstancePlan("decode1", "decode", 2, 43000, "n1", group=1)
    assert serve_mod.cluster_spec(plan(instances=(PE, DE, de1))) == {
        "prefill": [{"url": "http://127.0.0.1:41000", "node": "pe0"}],
        "decode": [{"url": "http://127.0.0.1:42000", "node": "de0", "group": 0},
                   {"url": "http://127.0.0.1:43000", "node": "n1", "group": 1}],
    }  # fmt: skip


def test_child_env_binds_each_instance_to_its_cores():
    pe = serve_mod.child_env("0", base={"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": "/x"})
    de = serve_mod.child_env("1", base={})
    assert (pe["VLLM_CPU_OMP_THREADS_BIND"], de["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve_mod.child_env(None, base={})  # the proxy
    assert pe["VLLM_CPU_KVCACHE_SPACE"] == "2" and de["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the caller's value wins
    assert de["VLLM_HOST_IP"] == "127.0.0.1" and de["HF_HUB_OFFLINE"] == "1"
    root = pe["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(root, "ascend_dualpath", "integrations", "vllm", "serve.py"))
    assert pe["PYTHONPATH"].endswith(os.pathsep + "/x")


def test_omp_binds_spread_over_the_cores():
    assert serve_mod.omp_binds(2, [0, 1]) == ["0", "1"]
    assert serve_mod.omp_binds(4, [0, 1]) == ["0", "1", "0", "1"]
    assert serve_mod.omp_binds(3, list(range(8))) == ["0-1", "2-4", "5-7"]


def test_make_plan_for_n_by_m_with_nodes_groups_caps_and_own_args(tmp_path):
    opts = ServeOptions(
        model=str(tmp_path), prefill=2, decode=2, nodes=("a", "b", "a", "b"), decode_groups=(0, 1), snic_mbps=400.0,
        node_snic_mbps={"b": 100.0}, instance_args={"decode1": ("--num-gpu-blocks-override", "8")}, split=True,
        beta_tokens=64,
    )  # fmt: skip
    p = serve_mod.make_plan(opts, "/s", cores=[0, 1])
    assert [(i.name, i.device_id, i.node, i.group, i.snic_mbps, i.bind) for i in p.instances] == [
        ("prefill0", 0, "a", 0, 400.0, "0"), ("prefill1", 1, "b", 0, 100.0, "1"),
        ("decode0", 2, "a", 0, 400.0, "0"), ("decode1", 3, "b", 1, 100.0, "1"),
    ]  # fmt: skip
    assert p.instances[3].vllm_args == ("--num-gpu-blocks-override", "8") and p.instances[2].vllm_args == ()
    ports = [i.port for i in p.instances]
    assert len(set(ports + [q + serve_mod.SIDE_PORT_OFFSET for q in ports])) == 8
    assert p.proxy_args == ("--placement", "scheduler", "--policy", "dual", "--startup-timeout", "300.0",
                            "--beta-tokens", "64", "--split")  # fmt: skip
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"prefill": [{"node": "x", "snic_mbps": 50}], "decode": [{"group": 3}, {}]}))
    q = serve_mod.make_plan(ServeOptions(model=str(tmp_path), layout=str(layout)), "/s", cores=[0, 1, 2, 3, 4, 5])
    assert [(i.name, i.node, i.group, i.snic_mbps, i.bind) for i in q.instances] == [
        ("prefill0", "x", 0, 50, "0-1"), ("decode0", "de0", 3, None, "2-3"), ("decode1", "de1", 0, None, "4-5"),
    ]  # fmt: skip


def test_parallel_instances_get_a_side_port_device_and_cores_per_worker(tmp_path):
    opts = ServeOptions(
        model=str(tmp_path), vllm_args=("-tp", "1"),
        instance_args={"prefill0": ("--tensor-parallel-size=2",), "decode0": ("--data-parallel-size", "2")},
    )  # fmt: skip
    p = serve_mod.make_plan(opts, "/s", cores=[0, 1, 2, 3])
    assert [(i.name, i.tp, i.dp, i.ranks, i.device_id, i.bind) for i in p.instances] == [
        ("prefill0", 2, 1, 2, 0, "0|1"), ("decode0", 1, 2, 2, 2, "2|3"),  # devices 0-1 and 2-3
    ]  # fmt: skip
    sides = [i.kv_port + k for i in p.instances for k in range(i.ranks)]
    assert len(set(sides + [i.port for i in p.instances])) == 6 and all(map(serve_mod._port_is_free, sides))
    spec = serve_mod.cluster_spec(p)
    assert spec["decode"][0] | {"url": ""} == {"url": "", "node": "de0", "group": 0, "dp": 2, "tp": 1}
    assert "dp" not in spec["prefill"][0]  # one engine: the proxy needs only its first side channel
    assert serve_mod.omp_binds([1, 2], [0, 1]) == ["0", "1|1"]  # more workers than cores: an instance's share its
    assert serve_mod.parallel_sizes(["-dp=3", "--tensor-parallel-size", "4", "-tp", "2"], "x") == (2, 3)
    for args, match in ((["-tp", "0"], "x: -tp '0' must be an int >= 1"), (["--data-parallel-size"], "''"),
                        (["-pp", "2"], "--pipeline-parallel-size 2: the DualPath connector supports 1")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            serve_mod.parallel_sizes(args, "x")
    with pytest.raises(ConfigError, match="decode0: -tp 'two'"):
        serve_mod.make_plan(ServeOptions(model=str(tmp_path), instance_args={"decode0": ("-tp", "two")}), "/s")


def test_make_plan_spaces_ports_and_devices_by_the_sizes_and_binds_each_rank(tmp_path):
    """A PE of tensor-parallel size 2 (its own args) and a DE of 1; then both at 2 (common args): each rank has its
    side port (base + rank), its emulated device and a core list of its own (``|`` between an instance's ranks)."""
    opts = ServeOptions(model=str(tmp_path), instance_args={"prefill0": ("--tensor-parallel-size", "2")})
    p = serve_mod.make_plan(opts, "/s", cores=[0, 1, 2, 3])
    assert [(i.name, i.device_id, i.bind) for i in p.instances] == [("prefill0", 0, "0|1"), ("decode0", 2, "2-3")]
    sides = [p.instances[0].kv_port, p.instances[0].kv_port + 1, p.instances[1].kv_port]
    assert len(set(sides + [i.port for i in p.instances])) == 5
    q = serve_mod.make_plan(ServeOptions(model=str(tmp_path), vllm_args=("-tp", "2")), "/s", cores=[0, 1])
    assert [(i.device_id, i.bind) for i in q.instances] == [(0, "0|0"), (2, "1|1")]  # no core shared by two


def test_kv_bytes_per_token_from_the_model_config(tmp_path):
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 3,
              "torch_dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert serve_mod.kv_bytes_per_token(str(tmp_path)) == 2 * 3 * 2 * 16 * 2
    assert serve_mod.kv_bytes_per_token(str(tmp_path / "none")) is None


def test_picked_ports_and_their_side_ports_are_free_and_distinct():
    ports = serve_mod.pick_instance_ports(3, taken={8000})
    everything = ports + [p + serve_mod.SIDE_PORT_OFFSET for p in ports]
    assert len(set(everything)) == 6 and 8000 not in everything
    assert all(serve_mod._port_is_free(p) for p in everything)
    # below the ephemeral range: no connecting socket (vLLM's start-up opens many) takes one meanwhile
    assert max(everything) < serve_mod.ephemeral_port_start(), everything


def test_options_name_the_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="--model '/nonexistent'"):
        ServeOptions(model="/nonexistent").validate()
    with pytest.raises(ConfigError, match="--block-size 48"):
        ServeOptions(model=str(tmp_path), block_size=48).validate()
    with pytest.raises(ConfigError, match="--snic-mbps 0"):
        ServeOptions(model=str(tmp_path), snic_mbps=0).validate()
    with pytest.raises(ConfigError, match="--node-snic-mbps b -1"):
        ServeOptions(model=str(tmp_path), node_snic_mbps={"b": -1}).validate()
    with pytest.raises(ConfigError, match="--prefill 0"):
        ServeOptions(model=str(tmp_path), prefill=0).validate()
    with pytest.raises(ConfigError, match="--nodes names 3 nodes for 2 instances"):
        serve_mod.instance_layout(ServeOptions(model=str(tmp_path), nodes=("a", "b", "c")))
    with pytest.raises(ConfigError, match=r"unknown \['decode5'\]"):
        serve_mod.instance_layout(ServeOptions(model=str(tmp_path), instance_args={"decode5": ()}))


def test_role_options_name_the_bad_value(tmp_path, monkeypatch):
    monkeypatch.delenv("ADP_SIDE_TOKEN", raising=False)
    good = dict(model=str(tmp_path), role="prefill", engine="mooncake", port=9000, kv_port=9100, store=str(tmp_path))
    ServeOptions(**good).validate()
    for change, match in [
        ({"role": "both"}, r"--role 'both' must be one of prefill, decode"),
        ({"engine": "npu"}, r"--engine 'npu': the npu engine is not wired into the connector yet"),
        ({"engine": "cuda"}, r"--role needs --engine mooncake: 'cuda' moves KV only inside one host"),
        ({"engine": "emulator"}, r"--role needs --engine mooncake: 'emulator' moves KV only inside one host"),
        ({"kv_port": None}, r"--kv-port None must be a TCP port other than --port 9000"),
        ({"kv_port": 9000}, r"--kv-port 9000 must be a TCP port other than --port 9000"),
        ({"store": str(tmp_path / "absent")}, r"--store '.*absent' must be an existing directory"),
        ({"node": "a b"}, r"--node 'a b' must be 1 to 64 letters"),
        ({"host": "my-host"}, r"--host must be an IPv4 address to bind, got 'my-host'"),
        ({"host": "10.0.0.5"}, r"--host is '10\.0\.0\.5', beyond loopback: .*ADP_SIDE_TOKEN or --side-token-file"),
        ({"decode": 2, "split": True}, r"--role starts one instance: --decode, --split belong to a deployment"),
    ]:
        with pytest.raises(ConfigError, match=match) as error:
            ServeOptions(**{**good, **change}).validate()
        assert "\n" not in str(error.value)


def test_a_bad_role_value_is_one_line_and_exit_2_before_any_work(tmp_path):
    argv = [sys.executable, "-m", "ascend_dualpath", "serve", "--role", "decode", "--model", str(tmp_path),
            "--port", "9000", "--kv-port", "9100", "--engine", "npu", "--store", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "s")}
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "serve: --engine 'npu': the npu engine is not wired into the connector yet (use one of emulator, mooncake, cuda)"
    ]
    assert not (tmp_path / "s").exists()  # no log directory: nothing was started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, pytest's init reaper or serve, has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pids, timeout_s=10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_stop_kills_a_tree_of_sleeps(tmp_path):
    # The child ignores SIGTERM and has a grandchild: only the SIGKILL of the group ends both.
    script = f"trap '' TERM; sleep 600 & echo $! > {tmp_path}/grandchild; wait"
    child = serve_mod.start_child("sleeper", ["bash", "-c", script], dict(os.environ), "http://unused", str(tmp_path))
    deadline = time.monotonic() + 10
    while not (tmp_path / "grandchild").exists() or not (tmp_path / "grandchild").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int((tmp_path / "grandchild").read_text())
    start = time.monotonic()
    stop([(child.process, True)], grace_s=1.0)
    assert time.monotonic() - start < 5.0
    assert child.process.returncode == -signal.SIGKILL
    assert _wait_dead([grandchild]) == []


def test_a_new_run_directory_is_short_and_removes_those_of_dead_serves(tmp_path, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    short = tmp_path / "t"
    short.mkdir()
    monkeypatch.setattr(serve_mod, "MAX_TMP_PATH", len(str(short)))
    monkeypatch.setattr(serve_mod.tempfile, "tempdir", str(short))
    shm = []  # what a dead serve's vLLM CPU workers left in /dev/shm goes with its run directory; a live one's stays
    for pid in (int(dead.stdout), os.getpid()):
        (short / f"adp-serve-{pid}-abc").mkdir()
        (short / f"adp-serve-{pid}-abc" / "socket").write_text("")
        ident = f"vllm_dist_test{os.getpid()}x{pid}"
        (short / f"adp-serve-{pid}-abc" / ident).write_text("")
        shm.append(Path(serve_mod.SHM_DIR) / f"{ident}-tp:0-[0-1]-cpushm_0")
        shm[-1].write_text("")
    (short / "adp-serve-store-x").mkdir()  # not a pid: not the reaper's
    try:
        run_dir = serve_mod.new_run_dir()
        assert [path.exists() for path in shm] == [False, True]
    finally:
        for path in shm:
            path.unlink(missing_ok=True)
    assert os.path.dirname(run_dir) == str(short) and os.path.basename(run_dir).startswith(f"adp-serve-{os.getpid()}-")
    assert sorted(os.listdir(short)) == sorted([f"adp-serve-{os.getpid()}-abc", "adp-serve-store-x",
                                                os.path.basename(run_dir)])  # fmt: skip
    monkeypatch.setattr(serve_mod, "MAX_TMP_PATH", len(str(short)) - 1)  # too long for vLLM's sockets
    assert serve_mod._short_tmp() == "/tmp"


def test_remove_fabric_shm_takes_only_that_fabric(tmp_path):
    for name in ("adp.fab1", "adp.fab1.12.0", "adp.fab2.0", "other"):
        (tmp_path / name).write_text("")
    assert serve_mod.remove_fabric_shm("fab1", shm_dir=str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["adp.fab2.0", "other"]


def test_remove_vllm_shm_takes_only_the_instances_of_that_run(tmp_path):
    """vLLM's CPU workers at tensor-parallel size 2 name their shared memory after the init file in their TMPDIR
    (serve's run directory): only those of this run's instances go."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir()
    shm.mkdir()
    for name in ("vllm_dist_aa", "vllm_dist_bb", "side_token"):
        (run / name).write_text("")
    mine = ["vllm_dist_aa-tp:0-[0-1]-cpushm_0", "vllm_dist_aa-tp:0-[0-1]-cpushm_1", "vllm_dist_bb-tp:0-[0-1]-cpushm_0"]
    others = ["vllm_dist_cc-tp:0-[0-1]-cpushm_0", "vllm_dist_aab-tp:0-[0-1]-cpushm_0", "adp.fab1"]
    for name in mine + others:
        (shm / name).write_text("")
    idents = serve_mod.vllm_dist_idents(str(run))
    assert idents == ["vllm_dist_aa", "vllm_dist_bb"]
    assert serve_mod.remove_vllm_shm(idents, shm_dir=str(shm)) == 3
    assert sorted(os.listdir(shm)) == sorted(others)
    assert serve_mod.vllm_dist_idents(str(tmp_path / "gone")) == []


class FakeDeployment:
    """``python -m ascend_dualpath serve`` with the fake vllm serve, in a subprocess."""

    def __init__(self, tmp_path, *extra, env_extra=None):
        env_extra = env_extra or {}
        self.records = tmp_path / "records"
        self.records.mkdir()
        self.tmp = tmp_path / "tmp"  # serve's run directory goes here: a serve killed with -9 cannot remove it
        self.tmp.mkdir()
        self.state = tmp_path / "state"  # XDG_STATE_HOME: where serve's default log directory goes
        (tmp_path / "model").mkdir()
        fake = tmp_path / "fake_vllm.py"
        fake.write_text(FAKE_VLLM)
        self.port = serve_mod.pick_instance_ports(1)[0]
        env = {**os.environ, "ADP_VLLM_SERVE_CMD": f"{shlex.quote(sys.executable)} {shlex.quote(str(fake))}",
               "FAKE_VLLM_DIR": str(self.records), "TMPDIR": str(self.tmp), "XDG_STATE_HOME": str(self.state), **env_extra}  # fmt: skip
        argv = [sys.executable, "-m", "ascend_dualpath", "serve", "--model", str(tmp_path / "model"),
                "--port", str(self.port), "--startup-timeout", "60", *extra]  # fmt: skip
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.known_pids: list[int] = []

    def wait_ready(self) -> str:
        line = self.process.stdout.readline()  # bounded: the start-up timeout ends serve, closing stdout
        assert line.startswith("serve: ready at "), (line, self.process.stderr.read() if not line else "")
        self.known_pids = self.pids()
        return line

    def instances(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.records.glob("*.json"))]

    def pids(self) -> list[int]:
        """The fakes, their sleeps and serve's other children (the proxy), read while serve runs."""
        fakes = [pid for rec in self.instances() for pid in (rec["pid"], rec["grandchild"])]
        with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as children:
            return sorted(set(fakes) | {int(pid) for pid in children.read().split()})

    def kill_leftovers(self) -> None:
        """After a failed test: SIGKILL whatever of the deployment still runs (serve and its children)."""
        if self.process.poll() is None:
            self.known_pids = self.pids()
            self.process.kill()
            self.process.communicate(timeout=10)
        for pid in self.known_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for record in self.instances():
            serve_mod.remove_fabric_shm(_fabric(record))


@pytest.fixture
def deploy(tmp_path):
    """Start a FakeDeployment (at most one per test); whatever it leaves running is killed at the end."""
    started = []

    def start(*extra, env_extra=None) -> FakeDeployment:
        started.append(FakeDeployment(tmp_path, *extra, env_extra=env_extra))
        return started[-1]

    yield start
    for deployment in started:
        deployment.kill_leftovers()


def _extra(record: dict) -> dict:
    config = json.loads(record["argv"][record["argv"].index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]


def _fabric(record: dict) -> str:
    return _extra(record)["fabric"]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serve_stops_on_signal_and_leaves_nothing_behind(deploy, signum, code):
    deployment = deploy("--", "--max-model-len", "256")
    ready = deployment.wait_ready()
    assert f"http://127.0.0.1:{deployment.port}/v1" in ready
    assert serve_mod.answers_health(f"http://127.0.0.1:{deployment.port}/health")  # the real proxy, both fakes up
    records = deployment.instances()
    assert sorted(r["bind"] for r in records) == sorted(serve_mod.omp_binds(2, sorted(os.sched_getaffinity(0))))
    assert {(r["host_ip"], r["offline"]) for r in records} == {("127.0.0.1", "1")}
    assert all(r["argv"][-2:] == ["--max-model-len", "256"] for r in records)
    fabric = _fabric(records[0])
    store = json.loads(records[0]["argv"][records[0]["argv"].index("--kv-transfer-config") + 1])
    store = store["kv_connector_extra_config"]["store"]
    assert os.path.isdir(store) and any(n.startswith(f"adp.{fabric}") for n in os.listdir("/dev/shm"))
    deployment.process.send_signal(signum)
    out, err = deployment.process.communicate(timeout=60)
    assert deployment.process.returncode == code, err
    assert out == ""  # after the ready line
    (log_dir,) = (deployment.state / "ascend_dualpath" / "serve").iterdir()  # the default: one per run
    assert err.splitlines() == [
        f"serve: logs in {log_dir} (one file per part, kept after exit)",
        f"serve: interrupted by {signal.Signals(signum).name}; 3 children stopped; temporary store removed; "
        f"logs kept in {log_dir}",
    ], err
    assert sorted(os.listdir(log_dir)) == ["cluster.json", "decode0.log", "prefill0.log", "proxy.log"]
    assert (log_dir / "proxy.log").read_text().startswith("=== serve (pid ")
    assert _wait_dead(deployment.known_pids) == []
    assert not any(n.startswith(f"adp.{fabric}") for n in os.listdir("/dev/shm"))
    run_dir = os.path.dirname(store)  # the children's TMPDIR (under /tmp when TMPDIR is too long for sockets)
    assert os.path.basename(run_dir).startswith(f"adp-serve-{deployment.process.pid}-")
    assert all(r["tmpdir"] == run_dir for r in records)
    assert not os.path.exists(run_dir) and list(deployment.tmp.iterdir()) == []


def test_one_role_instance_binds_its_host_and_kv_port_and_stops_on_sigterm(deploy, tmp_path, monkeypatch):
    monkeypatch.setenv("ADP_SIDE_TOKEN", "a-deployment-token-of-32-bytes!!")
    kv_port = serve_mod.pick_instance_ports(1)[0]
    (tmp_path / "shared").mkdir()
    deployment = deploy("--role", "decode", "--engine", "mooncake", "--kv-port", str(kv_port), "--store",
                        str(tmp_path / "shared"), "--node", "rack1", "--snic-mbps", "50")  # fmt: skip
    ready = deployment.wait_ready()
    assert ready.startswith(f"serve: ready at http://127.0.0.1:{deployment.port}/v1 (decode0, side channel "
                            f"tcp://127.0.0.1:{kv_port}, node rack1, engine mooncake;")  # fmt: skip
    (record,) = deployment.instances()
    argv, extra = record["argv"], _extra(record)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == str(deployment.port)
    assert (extra["side_port"], extra["engine"], extra["node"], extra["snic_mbps"]) == (
        kv_port,
        "mooncake",
        "rack1",
        50.0,
    )
    assert extra["store"] == str(tmp_path / "shared") and "side_token_file" not in extra  # ADP_SIDE_TOKEN, inherited
    assert len(deployment.known_pids) == 3  # the fake, its sleep, the watcher: no proxy
    deployment.process.send_signal(signal.SIGTERM)
    _, err = deployment.process.communicate(timeout=60)
    assert deployment.process.returncode == 143, err
    assert "1 children stopped; store kept at" in err
    assert _wait_dead(deployment.known_pids) == []
    assert (tmp_path / "shared").is_dir() and list(deployment.tmp.iterdir()) == []


def test_children_die_when_serve_is_killed(deploy, tmp_path):
    deployment = deploy("--store", str(tmp_path / "store"))
    deployment.wait_ready()
    pids = deployment.known_pids
    assert len(pids) == 6  # two fakes, their sleeps, the proxy, the watcher
    deployment.process.kill()
    deployment.process.wait(timeout=10)
    assert _wait_dead(pids) == []
    assert (tmp_path / "store").is_dir()  # a given store is the caller's (the fixture removes the shm files)


def test_a_child_that_dies_stops_serve_with_its_name(deploy):
    deployment = deploy()
    deployment.wait_ready()
    decode = max(deployment.instances(), key=lambda r: _extra(r)["device_id"])  # device 1 is the decode instance
    os.kill(decode["pid"], signal.SIGKILL)
    out, err = deployment.process.communicate(timeout=60)
    assert deployment.process.returncode == 1
    (log_dir,) = (deployment.state / "ascend_dualpath" / "serve").iterdir()
    assert "serve: decode0 exited with -9 while serving; last error line: " in err
    assert f"(log {log_dir / 'decode0.log'})" in err and f"logs kept in {log_dir}" in err
    assert _wait_dead(deployment.known_pids) == []
    assert (log_dir / "decode0.log").is_file()


def test_a_child_failing_at_start_up_is_named_with_its_last_error_line_and_the_given_log_dir(deploy, tmp_path):
    deployment = deploy("--log-dir", str(tmp_path / "logs"), env_extra={"FAKE_VLLM_FAIL": "1"})
    out, err = deployment.process.communicate(timeout=60)
    assert deployment.process.returncode == 1 and out == "", (out, err)
    log = tmp_path / "logs" / "decode0.log"
    assert (
        f"serve: decode0 exited with 3 during start-up; last error line: ValueError: fake vllm cannot start (log {log})"
        in err
    ), err
    assert err.splitlines()[0] == f"serve: logs in {tmp_path / 'logs'} (one file per part, kept after exit)"
    assert err.splitlines()[-1].endswith(f"logs kept in {tmp_path / 'logs'}")
    assert list(deployment.tmp.iterdir()) == []  # the temporary store went; the logs stay
    assert "ValueError: fake vllm cannot start" in log.read_text()


def test_last_error_line_prefers_the_end_of_a_traceback_or_an_error_record(tmp_path):
    log = tmp_path / "x.log"
    child = serve_mod.Child("x", "http://unused", None, str(log))
    assert child.last_error_line().startswith("(log unreadable")
    log.write_text("")
    assert child.last_error_line() == "(its log is empty)"
    log.write_text("INFO a\nTraceback (most recent call last):\n  File x\nRuntimeError: shape is invalid\nINFO bye\n\n")
    assert child.last_error_line() == "RuntimeError: shape is invalid"
    log.write_text("INFO a\nERROR 12-04 engine core died\nINFO b\n")
    assert child.last_error_line() == "ERROR 12-04 engine core died"
    log.write_text("ValueError: bad shape\nERROR x\nRuntimeError: Engine core failed. See root cause above.\n")
    assert child.last_error_line() == "ERROR x (then: RuntimeError: Engine core failed. See root cause above.)"
    log.write_text("INFO a\nINFO the last line\n")
    assert child.last_error_line() == "INFO the last line"


def test_two_by_two_deployment_gives_every_instance_its_node_group_device_and_the_proxy_all(deploy):
    deployment = deploy("--prefill", "2", "--decode", "2", "--nodes", "a,b,a,b", "--decode-groups", "0,1",
                        "--node-snic-mbps", "b=50", "--instance-args", "decode1=--num-gpu-blocks-override 8",
                        "--beta-tokens", "64")  # fmt: skip
    ready = deployment.wait_ready()
    for name in ("prefill0", "prefill1", "decode0", "decode1"):
        assert name in ready
    records = sorted(deployment.instances(), key=lambda r: _extra(r)["device_id"])
    extras = [_extra(r) for r in records]
    assert [e["device_id"] for e in extras] == [0, 1, 2, 3] and [e["node"] for e in extras] == ["a", "b", "a", "b"]
    assert [e.get("snic_mbps") for e in extras] == [None, 50.0, None, 50.0]
    assert len({e["fabric"] for e in extras}) == 1 and len({e["side_port"] for e in extras}) == 4
    (token_file,) = {e["side_token_file"] for e in extras}  # one token per deployment, in a file of mode 0600
    assert {r["token_mode"] for r in records} == {0o600} and os.path.exists(token_file)
    assert records[3]["argv"][-2:] == ["--num-gpu-blocks-override", "8"]
    assert "--num-gpu-blocks-override" not in records[2]["argv"]
    with urllib.request.urlopen(f"http://127.0.0.1:{deployment.port}/health", timeout=10) as resp:
        assert sorted(json.loads(resp.read())) == ["decode0", "decode1", "prefill0", "prefill1"]
    deployment.process.send_signal(signal.SIGTERM)
    deployment.process.communicate(timeout=60)
    assert deployment.process.returncode == 143
    assert not os.path.exists(token_file)
    assert _wait_dead(deployment.known_pids) == []
