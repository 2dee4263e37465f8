"""The connector's ``cuda`` engine: a PE and a DE in two processes on one GPU, over CUDA IPC and shared host memory.

Without a GPU: the engine is refused with one clear error, its hello message round-trips and a malformed one is
refused, a peer's addresses map into the link's regions or are refused. With one (marked ``cuda``): every read path
(pe, de, split) through :class:`~tests.integrations.vllm.cuda_harness.CudaDeployment` (vLLM's CUDA FLASH_ATTN cache
layout, no vLLM) leaves the DE caches bit-exact and every byte no request wrote still poisoned, and nothing in
``/dev/shm``; a peer on another host or an unseen GPU is refused at hello.
"""

from __future__ import annotations

import contextlib
import os

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import SHM_DIR, open_dataplane
from ascend_dualpath.dualpath.dataplane_cuda import NOTIFY_WORDS, LinkEngine, SharedHostRegion
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.errors import BackendUnavailable, BoundsError, ConfigError, QueueError
from ascend_dualpath.transport.segments import RemoteSlot
from tests.integrations.vllm.worker_harness import LAYOUT, assert_caches_equal, expected_de_caches, run_request

RANK = m.CudaRank(
    "boot-id", "GPU-0000", bytes(range(64)), (0x7F0000000000, 2 << 20), NOTIFY_WORDS, "adpcuda.1x" + "ab" * 8
)
PATHS = [("pe", False), ("de", False), ("de", True)]


def settings(tmp_path, role: str = "prefill") -> ConnectorSettings:
    return ConnectorSettings(role, str(tmp_path), "pe", 1e15, 7000, "unused", 5.0, engine="cuda",
                             hccl_buffer_mb=1, host_buffer_mb=1)  # fmt: skip


def test_a_host_region_file_a_dead_instance_left_is_removed_when_a_cuda_dataplane_opens(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left, alive = f"{SHM_DIR}/adpcuda.{dead.stdout.strip()}x{'0' * 16}", f"{SHM_DIR}/adpcuda.{os.getpid()}x{'1' * 16}"
    for path in (left, alive):
        open(path, "wb").close()
    try:
        with contextlib.suppress(BackendUnavailable):  # on a GPU the dataplane opens, and closes below
            open_dataplane(settings(tmp_path), 0).close()
        assert not os.path.exists(left) and os.path.exists(alive)  # a live instance's region stays
    finally:
        for path in (left, alive):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_the_cuda_engine_without_a_gpu_is_one_clear_error(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailable, match=r"engine 'cuda': the connector's cuda engine needs a CUDA GPU") as e:
        open_dataplane(settings(tmp_path), 0)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"the cuda dataplane makes its own engines"):
        open_dataplane(settings(tmp_path), 0, engines=lambda comm, rank: None)


def test_a_hello_carries_the_cuda_rank_info_and_a_malformed_one_is_refused():
    compat = m.Compat.of(LAYOUT, "cuda")
    hello = m.Hello(
        pe="tcp://pe", device_id=0, rank_info=RANK, host_mem=(1 << 40, 4 << 20, 0), speaks=m.Speaks.of(compat)
    )
    assert m.decode_request(m.encode(hello)) == hello
    welcome = m.Welcome(rank_info=RANK, host_mem=(1 << 41, 4 << 20, 0))
    assert m.decode_reply(m.encode(welcome)) == welcome
    raw = msgspec.to_builtins(hello)
    for change in ({"handle": "not bytes"}, {"window": [1]}, {"extra": 1}, {"type": "nixl"}):
        bad = {**raw, "rank_info": {**raw["rank_info"], **change}}
        with pytest.raises(m.ProtocolError, match="malformed"):
            m.decode_request(msgspec.msgpack.encode(bad))


def test_a_peer_host_region_name_that_is_no_instance_file_is_refused_before_anything_opens():
    for name in ("../etc/passwd", "adp.fabric", "adpcuda.1x/../../x", "adpcuda.12xzz"):
        with pytest.raises(ConfigError, match="no /dev/shm/adpcuda"):
            SharedHostRegion.open(name, 4096)


def _engine(regions):
    """A LinkEngine's address map alone (its constructor needs a GPU)."""
    engine = object.__new__(LinkEngine)
    engine.peer_device, engine.regions = type("D", (), {"index": 3})(), regions
    return engine


REGIONS = [(0x10000, 0x4000, 0x900000), (0x80000, 0x1000, 0x200000)]


@given(st.integers(0, 1), st.integers(0, 0x4000), st.integers(1, 0x4000))
def test_a_peer_address_goes_where_its_memory_is_mapped_here_or_is_refused(which, offset, nbytes):
    base, size, local = REGIONS[which]
    engine = _engine(REGIONS)
    if offset + nbytes <= size:
        assert engine.remote_slot(base + offset, nbytes) == RemoteSlot(3, local + offset, nbytes)
    else:
        with pytest.raises(BoundsError, match="outside the peer's window and host region"):
            engine.remote_slot(base + offset, nbytes)


# -- on a GPU --------------------------------------------------------------------------------------------------------
@pytest.fixture
def cuda_deploy(tmp_path):
    from tests.conftest import cuda_torch
    from tests.integrations.vllm.cuda_harness import CudaDeployment, leftover_shm

    cuda_torch()
    before = leftover_shm()
    made = []

    def make(**kwargs):
        made.append(CudaDeployment(tmp_path / f"store{len(made)}", **kwargs))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()
    assert leftover_shm() == before


@pytest.mark.cuda
def test_every_path_over_cuda_ipc_is_bit_exact_in_vllms_cuda_layout(cuda_deploy):
    d = cuda_deploy()
    written = []
    for i, (path, split) in enumerate(PATHS * 2):
        de_req, rows, bad = run_request(d, "pe0", "de0", 29 + 3 * i, 6, path, split, i)
        assert bad == set()
        written.append((de_req, rows))
    assert_caches_equal(d.call("de0", "caches", "de0"), expected_de_caches(written))
    status = d.call("pe0", "status", "pe0")
    assert (status["loads_pe"], status["loads_de"], status["loads_split"]) == (2, 2, 2)
    assert status["fallbacks"] == status["failures"] == status["takeovers"] == 0
    for name in ("pe0", "de0"):
        (link,) = d.call(name, "links", name)
        assert link["type"] == "CudaLink" and link["sent"] > 0, link


@pytest.mark.cuda
def test_later_requests_reuse_the_links_slots_with_fresh_magics(cuda_deploy):
    d = cuda_deploy()
    written = [run_request(d, "pe0", "de0", 21, 4, "de", False, seed)[:2] for seed in range(8)]
    assert_caches_equal(d.call("de0", "caches", "de0"), expected_de_caches(written))


@pytest.mark.cuda
def test_a_peer_on_another_host_or_an_unseen_gpu_is_refused_at_connect_and_a_closed_link_refuses_use(tmp_path):
    from tests.conftest import cuda_torch

    cuda_torch()
    dp = open_dataplane(settings(tmp_path), 0)
    link = dp.new_link("tcp://a", 1)
    try:
        mine = link.local_info()
        elsewhere = msgspec.structs.replace(mine, host_id="another-boot-id")
        with pytest.raises(ConfigError, match="the peer runs on another host"):
            dp.new_link("tcp://b", 2).connect(elsewhere, dp.host_mem())
        unseen = msgspec.structs.replace(mine, gpu="GPU-not-here")
        with pytest.raises(ConfigError, match="the peer's GPU GPU-not-here is not visible"):
            dp.new_link("tcp://c", 3).connect(unseen, dp.host_mem())
        assert link.comm.notify_value(0) == 0 and link.window_tensor(link.window_alloc(64), 64).is_cuda
    finally:
        dp.close()
    with pytest.raises(QueueError, match="the link is closed"):
        link.comm.notify_value(0)
    with pytest.raises(QueueError, match="the link is closed"):
        link.window_tensor(link.window.base_addr, 64)
