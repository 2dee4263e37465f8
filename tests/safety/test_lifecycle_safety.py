"""Memory safety, lifecycle rows: NaN bounds (D5, D6), what dead processes leave in /dev/shm (D9), closed objects used
again (D14), wrong Python types (D15), released leases (D16) and block files deleted behind a store (D17).

Where a hang or a crash is possible the scenario runs in a child process bounded by a timeout, and prints one JSON
line of what it saw; the parent asserts on it. Nothing may stay in /dev/shm or the temporary directory.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ascend_dualpath
from ascend_dualpath import errors

CHILD_TIMEOUT_S = 60.0
ROOT = Path(ascend_dualpath.__file__).resolve().parents[1]  # the package under test, for the child processes


def run_child(code: str, env: dict[str, str] | None = None, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """Run ``code`` in a fresh interpreter; returns the JSON object of its last output line."""
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child process was still waiting after {timeout_s} s: an unbounded wait")
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def shm_left(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"adp.{prefix}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- D5: NaN and infinite bounds of the host buffer and ADP_TIMEOUT_S ------------------------------------------
HOST_BUFFER_BOUNDS = """
    import json, math
    from ascend_dualpath.errors import AdmissionDeferred, ConfigError
    from ascend_dualpath.kv.buffers import HostBuffer

    seen = {}
    buffer = HostBuffer(4096, alignment=64)
    held = buffer.allocate("held", 4096)  # full: any admission has to wait
    for label, timeout in (("nan", math.nan), ("inf", math.inf), ("negative", -1.0)):
        try:
            buffer.allocate("late", 64, timeout_s=timeout)
            seen[label] = "allocated"
        except ConfigError as error:
            seen[label] = str(error)
    try:  # 0 keeps its documented meaning: do not wait
        buffer.allocate("late", 64, timeout_s=0)
    except AdmissionDeferred:
        seen["zero"] = "deferred"
    for label, timeout in (("ctor_nan", math.nan), ("ctor_inf", math.inf), ("ctor_zero", 0)):
        try:
            HostBuffer(4096, timeout_s=timeout)
            seen[label] = "accepted"
        except ConfigError as error:
            seen[label] = str(error)
    print(json.dumps(seen))
"""

ENV_TIMEOUT = """
    import json
    from ascend_dualpath.errors import ConfigError
    from ascend_dualpath.kv.buffers import HostBuffer

    buffer = HostBuffer(4096, alignment=64)
    held = buffer.allocate("held", 4096, timeout_s=1.0)
    try:
        buffer.allocate("late", 64)  # the default deadline comes from ADP_TIMEOUT_S
        print(json.dumps({"error": None}))
    except ConfigError as error:
        print(json.dumps({"error": str(error)}))
"""


def test_d05_nan_and_infinite_timeouts_are_refused_not_waited_on():
    seen = run_child(HOST_BUFFER_BOUNDS, timeout_s=30)
    for label, value in (("nan", "nan"), ("inf", "inf"), ("negative", "-1.0")):
        assert "timeout_s" in seen[label] and value in seen[label], seen
    assert seen["zero"] == "deferred"
    for label in ("ctor_nan", "ctor_inf", "ctor_zero"):
        assert "timeout_s" in seen[label], seen
    for raw in ("nan", "inf", "-inf", "0"):
        got = run_child(ENV_TIMEOUT, env={"ADP_TIMEOUT_S": raw}, timeout_s=30)
        assert got["error"] and "ADP_TIMEOUT_S" in got["error"], (raw, got)


# -- D6: the MoE Buffer's timeout --------------------------------------------------------------------------------
MOE_BUFFER_TIMEOUT = """
    import json, math
    import torch.distributed as dist
    from ascend_dualpath.errors import ConfigError
    from ascend_dualpath.moe import Buffer

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT",
                            rank=0, world_size=1)
    seen = {}
    for label, timeout in (("nan", math.nan), ("inf", math.inf), ("zero", 0.0)):
        try:
            Buffer(None, num_nvl_bytes=1 << 20, strategy="alltoall", timeout_s=timeout)
            seen[label] = "accepted"
        except ConfigError as error:
            seen[label] = str(error)
    dist.destroy_process_group()
    print(json.dumps(seen))
"""


def test_d06_moe_buffer_refuses_a_nan_timeout_before_any_wait():
    seen = run_child(MOE_BUFFER_TIMEOUT.replace("PORT", str(free_port())), timeout_s=60)
    for label in ("nan", "inf", "zero"):
        assert seen[label] != "accepted" and "timeout_s" in seen[label], seen
    assert "nan" in seen["nan"] and "inf" in seen["inf"]


# -- D9: a process dies with its fabric open ----------------------------------------------------------------------
CREATE_AND_DIE = """
    import os
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    fabric = emu.create_fabric(NAME)
    device = emu.open_device(fabric)
    region = device.alloc_region(4096, _ext.load().MemKind.HOST_DRAM, 7)
    print('{}', flush=True)
    os._exit(0)  # dies with everything open, as a crashed engine would
"""

ATTACH_AND_REAP = """
    import json, os
    from ascend_dualpath.backends import emulator as emu

    fabric = emu.attach_fabric(NAME, 5.0)
    reaped = fabric.reap_dead_owners()
    print(json.dumps({"reaped": reaped, "name_left": os.path.exists("/dev/shm/adp." + NAME)}))
"""

NEXT_START = """
    import json
    from ascend_dualpath.backends import emulator as emu

    with emu.emulated_devices(1):  # its create_fabric sweeps what dead processes left
        pass
    print(json.dumps({}))
"""


def _d09_scenario() -> None:
    """A dead process's fabric: a process that attaches to it reaps it, and the next start removes another. The test
    claims each fabric while it inspects what the dead process left, so other library processes starting meanwhile
    (their sweep) cannot take it away first."""
    from ascend_dualpath.backends import emulator as emu

    name = emu.new_fabric_name("d9r")
    try:
        with emu.claim_fabric(name):
            run_child(CREATE_AND_DIE.replace("NAME", repr(name)))
            assert shm_left(name), "the dead process left nothing: the scenario did not happen"
            seen = run_child(ATTACH_AND_REAP.replace("NAME", repr(name)))
        assert seen["reaped"] >= 2 and not seen["name_left"], seen  # its region, its QP-less device, its name
        assert shm_left(name) == []

        name = emu.new_fabric_name("d9s")
        with emu.claim_fabric(name):
            run_child(CREATE_AND_DIE.replace("NAME", repr(name)))
            assert shm_left(name)
        run_child(NEXT_START)
        assert shm_left(name) == [], "the next start left the dead process's fabric behind"
    finally:
        for leftover in shm_left("d9"):
            os.unlink(f"/dev/shm/{leftover}")


def test_d09_reap_and_the_next_start_remove_a_dead_processs_fabric_file():
    _d09_scenario()


REAP_LOOP = """
    import time
    from ascend_dualpath.backends import emulator as emu

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # another library process starting again and again: each start sweeps
        emu.reap_stale_shm()
        time.sleep(0.001)
"""


def test_d09_holds_while_other_library_processes_start_and_sweep():
    """The race the suite hit: any process that starts the library sweeps every dead process's fabric, the one a
    test or an engine is about to attach to included, unless it is claimed."""
    sweeper = subprocess.Popen([sys.executable, "-c", textwrap.dedent(REAP_LOOP)], cwd=ROOT)
    try:
        time.sleep(1.0)  # it sweeps by now
        for _ in range(3):
            _d09_scenario()
        assert sweeper.poll() is None, "the sweeping process died: the scenario ran without its sweeps"
    finally:
        sweeper.kill()
        sweeper.wait(10)


# -- D14: closed objects used again -----------------------------------------------------------------------------
CLOSED_OBJECTS = """
    import json, tempfile
    import torch
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.errors import QueueError
    from ascend_dualpath.kv.layout import KVLayout
    from ascend_dualpath.kv.store import LocalBlockStore

    C = _ext.load()
    seen = {}

    def attempt(label, call):
        try:
            call()
            seen[label] = "worked"
        except QueueError as error:
            seen[label] = str(error)

    with emu.emulated_devices(1) as (device,):
        region = device.alloc_region(8192, C.MemKind.DEVICE_GM, 7)
        write = C.WorkRequest(C.OPCODE_WRITE, region.addr, region.lkey, 64, region.addr + 4096, region.rkey)
        cq = device.create_cq(8)
        cq.close()
        attempt("cq_poll", lambda: cq.poll(1, 0.0))
        attempt("qp_on_closed_cq", lambda: device.create_qp(cq, None, 8, 0))
        cq2 = device.create_cq(8)
        qp = device.create_qp(cq2, None, 8, 0)
        qp.post([write], 0.0, 5.0)
        qp.drain(5.0)
        assert len(cq2.poll(1, 5.0)) == 1
        cq2.close()
        attempt("post_into_closed_cq", lambda: qp.post([write], 0.0, 1.0))
        attempt("doorbell_into_closed_cq", lambda: qp.ring_doorbell(0, 0.0))
        qp.close()
        attempt("closed_qp_post", lambda: qp.post([write], 0.0, 1.0))
        attempt("closed_qp_wqe", lambda: qp.write_wqe_bytes(0, bytes(48)))

    fabric = emu.create_fabric()
    device = emu.open_device(fabric)
    fabric.close()
    attempt("region_after_fabric_close", lambda: device.alloc_region(4096, C.MemKind.HOST_DRAM, 7))
    attempt("cq_after_fabric_close", lambda: device.create_cq(8))
    attempt("device_after_fabric_close", lambda: emu.open_device(fabric, 1))
    device.close()

    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    with tempfile.TemporaryDirectory() as root:
        store = LocalBlockStore(root, layout)
        block_id = bytes(range(16))
        store.write_block(block_id, None, torch.zeros(layout.full_block_bytes, dtype=torch.uint8))
        store.close()
        attempt("store_contains", lambda: store.contains(block_id))
        attempt("store_read", lambda: store.read_into(block_id, torch.empty(layout.full_block_bytes, dtype=torch.uint8)))
        attempt("store_write", lambda: store.write_block(bytes(16), None, torch.zeros(layout.full_block_bytes,
                                                                                      dtype=torch.uint8)))
        attempt("store_prefix", lambda: store.longest_prefix([block_id]))
    print(json.dumps(seen))
"""


def test_d14_closed_cq_qp_fabric_and_store_refuse_use_naming_themselves():
    seen = run_child(CLOSED_OBJECTS)
    named = {
        "cq_poll": "CQ",
        "qp_on_closed_cq": "CQ",
        "post_into_closed_cq": "send CQ",
        "doorbell_into_closed_cq": "send CQ",
        "closed_qp_post": "qpn",
        "closed_qp_wqe": "qpn",
        "region_after_fabric_close": "fabric",
        "cq_after_fabric_close": "fabric",
        "device_after_fabric_close": "fabric",
        "store_contains": "block store",
        "store_read": "block store",
        "store_write": "block store",
        "store_prefix": "block store",
    }
    for label, name in named.items():
        assert name in seen[label] and "closed" in seen[label], (label, seen[label])


# -- D15: wrong Python types ------------------------------------------------------------------------------------
def _type_error_cases(tmp: str):
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.kv.buffers import HostBuffer
    from ascend_dualpath.kv.layout import KVLayout
    from ascend_dualpath.kv.read_queue import ReadQueue
    from ascend_dualpath.kv.store import LocalBlockStore
    from ascend_dualpath.moe import Buffer
    from ascend_dualpath.transport.emulator import EmulatedTransferEngine
    from ascend_dualpath.transport.segments import RemoteSlot

    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    store = LocalBlockStore(tmp, layout)
    dest = torch.empty(layout.full_block_bytes, dtype=torch.uint8)
    yield "max_regions", "str", lambda: emu.create_fabric(max_regions="4096")
    yield "name", "int", lambda: emu.attach_fabric(7, 1.0)
    yield "fabric", "str", lambda: emu.open_device("fabric0")
    yield "product", "int", lambda: emu.product_profile(3)
    yield "link_bytes_per_ns", "str", lambda: emu.cost_model(link_bytes_per_ns="fast")
    yield "capacity_bytes", "str", lambda: HostBuffer("4096")
    yield "alignment", "float", lambda: HostBuffer(4096, alignment=64.0)
    yield "nbytes", "str", lambda: HostBuffer(4096).allocate("r", "64")
    yield "timeout_s", "str", lambda: HostBuffer(4096, timeout_s="1")
    yield "root", "int", lambda: LocalBlockStore(123, layout)
    yield "layout", "str", lambda: LocalBlockStore(tmp, "mla")
    yield "block_id", "str", lambda: store.read_into("00" * 16, dest)
    yield "parent_id", "int", lambda: store.write_block(bytes(16), 5, dest)
    yield "bandwidth_bytes_per_s", "str", lambda: ReadQueue(store, "50e9")
    yield "num_nvl_bytes", "str", lambda: Buffer(None, num_nvl_bytes="1024")
    yield "low_latency_mode", "str", lambda: Buffer(None, low_latency_mode="yes")
    with emu.emulated_devices(1) as (device,):
        comm = emu.init_comm(device)
        engine = EmulatedTransferEngine(comm, 0, timeout_s=5.0)
        slot = RemoteSlot(comm.windows_in.addr, 4096, comm.windows_in.rkey)
        yield "sources", "str", lambda: engine.submit("segments", slot)
        yield "sources[0]", "int", lambda: engine.submit([1234], slot)
        yield "remote", "tuple", lambda: engine.submit([], (0, 4096, 1))
        comm.close()


def test_d15_wrong_types_raise_a_library_error_naming_the_argument_and_the_type():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, got, call in _type_error_cases(tmp):
            try:
                call()
                failures.append(f"{name}: accepted")
            except Exception as error:  # noqa: BLE001 (the class is what is checked)
                library = isinstance(error, errors.AdpError) and isinstance(error, TypeError)
                if not (library and name in str(error) and got in str(error)):
                    failures.append(f"{name}: {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)
    assert issubclass(errors.ArgumentTypeError, errors.ConfigError)


# -- D16: a released lease ---------------------------------------------------------------------------------------
def test_d16_a_released_lease_can_no_longer_write_into_the_buffer():
    from ascend_dualpath.kv.buffers import HostBuffer

    buffer = HostBuffer(8192, alignment=4096)
    lease = buffer.allocate("old", 4096)
    tensor, view, piece = lease.tensor, lease.view, lease.slice(0, 64).view
    lease.release()
    successor = buffer.allocate("new", 4096)
    assert successor.offset == lease.offset  # the same bytes: a late write would land in the successor
    successor.tensor.fill_(0x11)
    late_writes = [
        lambda: tensor.copy_(torch.full((4096,), 0xEE, dtype=torch.uint8)),
        lambda: tensor.__setitem__(0, 0xEE),
        lambda: view.__setitem__(0, 0xEE),
        lambda: piece.__setitem__(slice(0, 4), b"\xee" * 4),
    ]
    for write in late_writes:
        with pytest.raises((RuntimeError, IndexError, ValueError)):
            write()
    for accessor in (lambda: lease.tensor, lambda: lease.view, lambda: lease.addr, lambda: lease.slice(0, 8)):
        with pytest.raises(errors.InvalidKey, match="was released"):
            accessor()
    assert bool((successor.tensor == 0x11).all()), "a released lease's write reached its successor"
    successor.release()
    buffer.check_invariants()


# -- D17: a block file deleted behind the store ------------------------------------------------------------------
def test_d17_a_block_file_deleted_behind_the_store_is_a_miss():
    from ascend_dualpath.kv.layout import KVLayout, block_hashes
    from ascend_dualpath.kv.store import LocalBlockStore

    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    blocks = torch.randint(
        0, 256, (4, layout.full_block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(17)
    )
    ids = block_hashes(list(range(4 * layout.block_tokens)), layout.block_tokens, namespace=layout.fingerprint())
    dest = torch.empty(layout.full_block_bytes, dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as root:
        store = LocalBlockStore(root, layout)
        parent = None
        for block_id, block in zip(ids, blocks, strict=True):
            store.write_block(block_id, parent, block)
            parent = block_id
        assert store.longest_prefix(ids) == 4
        store.path_of(ids[2]).unlink()  # behind the store's back
        assert not store.contains(ids[2])
        assert store.longest_prefix(ids) == 2
        assert not store.contains(ids[3]), "a descendant of the vanished block is unreachable"
        store.read_into(ids[1], dest)
        assert torch.equal(dest, blocks[1])
        store.path_of(ids[0]).unlink()
        with pytest.raises(errors.StorageReadError) as raised:
            store.read_into(ids[0], dest)  # ENOENT on read: a miss that drops the entry and its descendants
        assert raised.value.errno == 2
        assert store.longest_prefix(ids) == 0 and not store.contains(ids[1])
        store.close()
