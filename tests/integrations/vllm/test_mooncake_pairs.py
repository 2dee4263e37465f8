"""The connector's PE and DE halves moving KV over the Mooncake Transfer Engine (TCP on loopback, P2P handshake).

In-process workers (:mod:`tests.integrations.vllm.worker_harness`) with ``engine='mooncake'``: each (PE, DE) link is
one Mooncake engine per side, so the two instances could be on different hosts; nothing goes through the emulated
fabric. vLLM's forward is scripted; the DE caches are checked bit for bit on every read path.
"""

from __future__ import annotations

import os

import pytest

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import SHM_DIR, MooncakeLink, open_dataplane
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.errors import ConfigError, ProtocolError
from tests.integrations.vllm.worker_harness import (
    LAYOUT,
    assert_caches_equal,
    expected_de_caches,
    run_request,
)

pytest.importorskip(
    "mooncake.engine",
    reason="the Mooncake Transfer Engine is optional: pip install 'ascend_dualpath[mooncake]' (docs/mooncake.md)",
)

PATHS = [("pe", False), ("de", False), ("de", True)]


def test_every_path_over_mooncake_is_bit_exact_and_leaves_nothing_in_dev_shm(deploy):
    d = deploy(1, 2, engine="mooncake")
    written: dict[str, list] = {"de0": [], "de1": []}
    for i, (path, split) in enumerate(PATHS * 2):
        de = f"de{i % 2}"
        de_req, rows, bad = run_request(d, "pe0", de, 29 + 3 * i, 6, path, split, i)
        assert bad == set()
        written[de].append((de_req, rows))
    for de in ("de0", "de1"):
        assert_caches_equal(d.instances[de].caches, expected_de_caches(written[de]))
    pe = d.instances["pe0"]
    status = pe.status()
    assert (status["loads_pe"], status["loads_de"], status["loads_split"]) == (2, 2, 2)
    assert status["fallbacks"] == status["failures"] == 0
    links = list(pe.worker.dataplane.links.values())
    assert len(links) == 2 and all(isinstance(link, MooncakeLink) for link in links)
    assert all(link.leg.kinds_used.keys() == {"host"} and link.leg.bytes_sent > 0 for link in links)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"adp.{d.fabric}")]  # no fabric was made


def test_a_later_request_reuses_the_links_notify_slots_with_fresh_magics(deploy):
    """Ten DE-path loads one after another reuse one notify-slot group: a stale value never passes for a fresh one."""
    d = deploy(1, 1, engine="mooncake")
    written = [run_request(d, "pe0", "de0", 21, 4, "de", False, seed)[:2] for seed in range(10)]
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches(written))


def test_an_emulator_pe_and_a_mooncake_de_refuse_each_other_at_hello_naming_both_engines(deploy):
    d = deploy(1, 1, engine={"de0": "mooncake"})
    pe, de = d.instances["pe0"].worker, d.instances["de0"]
    with pytest.raises(ProtocolError, match=r"engine 'mooncake-tcp' here, 'emulator' there"):
        pe.prefill.connect_peer(de.address)
    assert not pe.prefill._peers and not de.worker.dataplane.links
    assert de.worker.dataplane.compat(LAYOUT) == m.Compat.of(LAYOUT, "mooncake-tcp")


def test_the_dataplane_refuses_unwired_engines_and_foreign_engine_factories(tmp_path):
    def settings(engine: str) -> ConnectorSettings:
        return ConnectorSettings("prefill", str(tmp_path), "pe", 1e15, 7000, "unused", 5.0, engine=engine,
                                 hccl_buffer_mb=1, host_buffer_mb=1)  # fmt: skip

    with pytest.raises(ConfigError, match=r"engine 'npu': the npu engine is not wired into the connector yet"):
        open_dataplane(settings("npu"), 0)
    with pytest.raises(ConfigError, match=r"engines= is emulator-only"):
        open_dataplane(settings("mooncake"), 0, engines=lambda comm, rank: None)
    dp = open_dataplane(settings("mooncake"), 0)
    try:  # device ids name no memory on Mooncake: two DEs on other hosts may both be device 1
        assert dp.new_link("tcp://de0", 1).peer_device == dp.new_link("tcp://de1", 1).peer_device == 1
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith("adp.unused")]
    finally:
        dp.close()
