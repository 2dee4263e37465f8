"""Tensor parallelism on the real connector workers (no vLLM), equal sizes on both sides.

:class:`~tests.integrations.vllm.worker_harness.TpDeployment`: one PE and one DE of ``tp`` ranks each, every rank of an
instance given the same step metadata (the peer named by its rank-0 side address), PE rank ``r`` finding DE rank ``r``
at the DE's base port + ``r``; every worker holds its rank's heads (GQA) or the whole latent (MLA) and reads only its
byte ranges of the stored full blocks. The DE caches are checked bit for bit per rank (poisoned bytes nobody may write
stay), and the storage NICs' accounting against one copy of the hit KV.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import SHM_DIR
from ascend_dualpath.dualpath.side_channel import PeerClient
from ascend_dualpath.errors import ProtocolError, WaitTimeout
from tests.integrations.vllm.worker_harness import Model, TpDeployment, assert_caches_equal, expected_de_caches

PATHS = [("pe", False), ("de", False), ("de", True)]
MODELS = [("gqa", 4), ("gqa", 8), ("gqa", 2), ("mla", 1)]


@pytest.fixture
def tp_deploy(tmp_path):
    made = []

    def make(*args, root=None, **kwargs):
        made.append(TpDeployment(root or tmp_path / f"store{len(made)}", *args, **kwargs))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"adp.{deployment.fabric}")]


def _copies(kind: str, kv_heads: int, tp: int) -> int:
    """Copies of the hit KV an instance pair reads: a GQA head once (by each rank holding it when heads are
    replicated); MLA's latent, which every rank holds, once per rank (not yet once per instance)."""
    return tp if kind == "mla" else max(1, tp // kv_heads)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("kind", "kv_heads"), MODELS, ids=[f"{k}{h}" for k, h in MODELS])
def test_every_rank_moves_its_share_on_every_path_bit_exact(tp_deploy, tp, kind, kv_heads):
    if kind == "gqa" and kv_heads < tp and tp != 4:
        pytest.skip("replicated heads: one case (2 heads over 4 ranks) is enough")
    d = tp_deploy(tp, tp, kind, kv_heads)
    written = [[] for _ in range(tp)]
    hit_blocks, full = 5, d.model.full.full_block_bytes
    copies = _copies(kind, kv_heads, tp)
    for i, (path, split) in enumerate(PATHS):
        before = {name: d.bytes_read(name) for name in ("pe0", "de0")}
        for rank, (de_req, rows) in enumerate(d.run("pe0", "de0", 23 + i, hit_blocks, path, split, seed=7 * i)):
            written[rank].append((de_req, rows))
        read = {name: d.bytes_read(name) - before[name] for name in before}
        assert read["pe0"] + read["de0"] == copies * hit_blocks * full, (path, split, read)
        if not split:  # the path's side alone reads
            assert read["de0" if path == "pe" else "pe0"] == 0, (path, read)
    for rank, rank_written in enumerate(written):
        expected = expected_de_caches(rank_written, Model(kind, kv_heads, tp, rank))
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected)
        status = d.instances[f"pe0/{rank}"].status()
        assert (status["loads_pe"], status["loads_de"], status["loads_split"]) == (1, 1, 1)
        assert status["fallbacks"] == status["failures"] == 0


@pytest.mark.parametrize(("kind", "kv_heads"), [("gqa", 4), ("mla", 1)], ids=["gqa4", "mla"])
def test_a_store_written_once_is_read_exact_at_every_size(tp_deploy, tmp_path, kind, kv_heads):
    """One stored prefix (full blocks, every head) read by deployments of sizes 1, 2 and 4 on one store."""
    root = tmp_path / "shared"
    sizes = [tp_deploy(tp, tp, kind, kv_heads, root=root) for tp in (1, 2, 4)]
    rows = sizes[0].true_rows(11, 4 * 4 + 3, sizes[0].model.full)
    ids = sizes[0].store_prefix(rows, 4, 77)
    for d in sizes:
        tp = d.tp["de0"]
        before = d.bytes_read("de0")
        done = d.run("pe0", "de0", 4 * 4 + 3, 4, "de", False, seed=11, ids=ids)
        assert d.bytes_read("de0") - before == _copies(kind, kv_heads, tp) * 4 * d.model.full.full_block_bytes
        for rank, written in enumerate(done):
            assert_caches_equal(
                d.instances[f"de0/{rank}"].caches, expected_de_caches([written], Model(kind, kv_heads, tp, rank))
            )


def test_the_compatibility_digest_is_the_same_at_every_size(tp_deploy):
    d1, d2 = tp_deploy(1, 1, "gqa", 4), tp_deploy(2, 2, "gqa", 4)
    digests = {
        inst.worker.dataplane.compat(inst.worker.shard.full).digest for d in (d1, d2) for inst in d.instances.values()
    }
    assert len(digests) == 1
    assert d2.instances["pe0/1"].worker.layout != d1.instances["pe0/0"].worker.layout  # yet the ranks' rows differ


def test_a_pe_of_another_size_is_refused_at_hello_naming_both(tp_deploy):
    d = tp_deploy(2, 1, "gqa", 4)
    pe, de = d.instances["pe0/0"].worker, d.instances["de0/0"]
    both = r"rank 0 of 1 at DE de0, rank 0 of 2 at PE tcp://.*: a pair needs equal tensor-parallel sizes"
    with pytest.raises(ProtocolError, match=both):
        pe.prefill.connect_peer(de.address)
    assert not pe.prefill._peers and not de.worker.dataplane.links


def test_a_pe_rank_the_de_has_no_rank_for_says_which_size_it_needs(tp_deploy):
    d = tp_deploy(2, 1, "gqa", 4)
    pe, de = d.instances["pe0/1"].worker, d.instances["de0/0"]
    pe.prefill.settings = dataclasses.replace(pe.settings, timeout_s=0.3)  # nothing listens at the DE's port + 1
    with pytest.raises(WaitTimeout, match=r"DE rank 1 of the DE at tcp://.*needs tensor-parallel size 2 too"):
        pe.prefill.connect_peer(de.address)
    assert not pe.prefill._peers


@pytest.mark.parametrize(("size", "rank", "why"), [(3, 0, "4 KV heads cannot be sharded over tensor-parallel size 3"),
                                                   (2, 2, "rank 2 out of range")])  # fmt: skip
def test_a_peer_rank_whose_shard_cannot_be_matched_is_refused_at_hello_naming_both(tp_deploy, size, rank, why):
    d = tp_deploy(2, 2, "gqa", 4)
    pe, de = d.instances["pe0/0"].worker, d.instances["de0/0"]
    speaks = m.Speaks.of(pe.dataplane.compat(pe.shard.full))
    hello = m.Hello(pe=pe.side.address, device_id=0, rank_info=b"", host_mem=(0, 0, 0), speaks=speaks,
                    tp_size=size, tp_rank=rank)  # fmt: skip
    client = PeerClient(de.address, 5.0)
    try:
        with pytest.raises(ProtocolError, match=rf"rank 0 of 2 at DE de0\.tp0, rank {rank} of {size} at PE .*{why}"):
            client.request(hello)
    finally:
        client.close()
    assert not de.worker.dataplane.links  # refused before any link was made
