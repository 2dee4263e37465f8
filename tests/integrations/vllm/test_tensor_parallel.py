"""Tensor parallelism on the real connector workers (no vLLM), of equal or different sizes on the two sides.

:class:`~tests.integrations.vllm.worker_harness.TpDeployment`: one PE of ``pe_tp`` ranks and one DE of ``de_tp`` ranks,
every rank of an instance given the same step metadata (the peer named by its rank-0 side address); a PE rank asks the
DE's rank 0 for its size and pairs with each DE rank it is a source of (``KVShard.sources``: equal sizes pair rank
``r`` with rank ``r``), at the DE's base port + that rank; every worker holds its rank's heads (GQA) or the whole latent
(MLA) and reads only its byte ranges of the stored full blocks. The DE caches are checked bit for bit per rank
(poisoned bytes nobody may write stay), the PE caches' hit rows after each layer's load, and the storage NICs'
accounting against the copies of the hit KV the pairs move (one per instance for GQA whose heads no rank replicates).
"""

from __future__ import annotations

import os

import pytest

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import SHM_DIR
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.side_channel import PeerClient, XferParams
from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec, SaveSpec
from ascend_dualpath.errors import ProtocolError
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata
from tests.integrations.vllm.worker_harness import (
    BLOCK,
    Model,
    TpDeployment,
    assert_caches_equal,
    expected_de_caches,
    on_ranks,
)

PATHS = [("pe", False), ("de", False), ("de", True)]
MODELS = [("gqa", 4), ("gqa", 8), ("gqa", 2), ("mla", 1)]
SIZES = [(pe, de) for pe in (1, 2, 4) for de in (1, 2, 4)]


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


@pytest.mark.parametrize(("pe_tp", "de_tp"), SIZES, ids=[f"pe{p}-de{d}" for p, d in SIZES])
@pytest.mark.parametrize(("kind", "kv_heads"), MODELS, ids=[f"{k}{h}" for k, h in MODELS])
def test_every_rank_moves_its_share_on_every_path_bit_exact(tp_deploy, pe_tp, de_tp, kind, kv_heads):
    """Every path: each DE rank's cache bit-exact (poison kept), the PE ranks' hit rows there before each layer's
    attention (the harness checks), and one copy of the hit KV read from storage per request whatever the sizes:
    heads no rank replicates are each read by the one rank pair holding them, MLA's latent and replicated heads by
    the request's lead pair only, whose replicas take them from it inside the instance."""
    d = tp_deploy(pe_tp, de_tp, kind, kv_heads)
    written = [[] for _ in range(de_tp)]
    hit_blocks, full = 5, d.model.full.full_block_bytes
    for i, (path, split) in enumerate(PATHS):
        before = {name: d.bytes_read(name) for name in ("pe0", "de0")}
        for rank, (de_req, rows) in enumerate(d.run("pe0", "de0", 23 + i, hit_blocks, path, split, seed=7 * i)):
            written[rank].append((de_req, rows))
        read = {name: d.bytes_read(name) - before[name] for name in before}
        assert read["pe0"] + read["de0"] == hit_blocks * full, (path, split, read)
        if path == "pe":  # the path's side alone reads
            assert read["de0"] == 0, (path, read)
    for rank, rank_written in enumerate(written):
        expected = expected_de_caches(rank_written, Model(kind, kv_heads, de_tp, rank))
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected)
    pe = [d.instances[name].status() for name in d.ranks("pe0")]
    # one load per request and instance (KVShard.counts_requests; through legs, on the first), whatever the sizes
    loads = {path: sum(status[f"loads_{path}"] for status in pe) for path in ("pe", "de", "split")}
    assert sum(loads.values()) == 3 and loads["pe"] == 1 and loads["de"] >= 1, loads  # a split may size a share at 0
    assert sum(status["fallbacks"] + status["failures"] for status in pe) == 0


@pytest.mark.parametrize(("pe_tp", "de_tp"), [(2, 1), (1, 2), (4, 2)], ids=["pe2-de1", "pe1-de2", "pe4-de2"])
def test_a_de_rank_whose_read_fails_leaves_its_pair_to_the_pe_rank_bit_exact(tp_deploy, pe_tp, de_tp):
    """Different sizes, DE read path: DE rank 0's read of one hit block fails; only the pair that read it falls
    back (its PE rank, or the PE rank's leg to it, reads that DE half itself), the other pairs go on pushing, and
    every DE rank's cache is bit-exact with nothing recomputed."""
    d = tp_deploy(pe_tp, de_tp, "gqa", 8)
    ids = d.store_prefix(d.true_rows(5, 23, d.model.full), 5, 4242)
    store = d.instances["de0/0"].worker.store
    getattr(store, "store", store).faults.fail_next_read(ids[3])  # the first pair to read block 3 fails
    done = d.run("pe0", "de0", 23, 5, "de", False, seed=5, ids=ids)
    for rank, written in enumerate(done):
        expected = expected_de_caches([written], Model("gqa", 8, de_tp, rank))
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected)
    pe = [d.instances[name].status() for name in d.ranks("pe0")]
    assert sum(status["takeovers"] for status in pe) == 1
    assert sum(status["failures"] for status in pe) == 0


@pytest.mark.parametrize(
    ("pe_tp", "de_tp"), [(2, 1), (1, 2), (1, 4), (2, 2)], ids=["pe2-de1", "pe1-de2", "pe1-de4", "pe2-de2"]
)
@pytest.mark.parametrize(("path", "split"), PATHS, ids=["pe", "de", "split"])
@pytest.mark.parametrize(("kind", "heads"), [("gqa", 8), ("mla", 1)], ids=["gqa8", "mla"])
def test_reads_ahead_of_the_step_are_ready_once_every_pair_read_them(tp_deploy, pe_tp, de_tp, path, split, kind, heads):
    """The read before the batch at different sizes: each PE rank reads ahead (through a leg per DE rank where it
    has several) and reports the request ready with every hit token once all its pairs' reads ended (MLA: the
    request's lead reads, its replicas report at once: vLLM waits for every rank's report); the step then takes it,
    bit-exact on every DE rank."""
    d = tp_deploy(pe_tp, de_tp, kind, heads)
    done = d.run("pe0", "de0", 23, 5, path, split, seed=9, ahead=True)
    for rank, written in enumerate(done):
        expected = expected_de_caches([written], Model(kind, heads, de_tp, rank))
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected)
    for name in d.ranks("pe0"):
        assert d.instances[name].worker.prefill.pending_prefetches() == 0


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
        assert d.bytes_read("de0") - before == 4 * d.model.full.full_block_bytes  # one copy at every size
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


def test_a_pe_rank_that_is_no_source_of_the_de_rank_is_refused_at_hello_naming_both(tp_deploy):
    """MLA, a PE of size 2 and a DE of size 1: DE rank 0 takes its latent from PE rank 0; PE rank 1 (which holds the
    same latent, and takes a request's hit rows from PE rank 0) pairs with no DE rank, and its hello to DE rank 0 is
    refused before any link is made."""
    d = tp_deploy(2, 1, "mla", 1)
    pe, de = d.instances["pe0/1"].worker, d.instances["de0/0"]
    with pytest.raises(ProtocolError, match=r"PE rank 1 of 2 pairs with DE ranks \[\] of 1 at .*, not with one"):
        pe.prefill.connect_peer(de.address)
    assert not pe.prefill._peers
    speaks = m.Speaks.of(pe.dataplane.compat(pe.shard.full))
    hello = m.Hello(pe=pe.side.address, device_id=0, rank_info=b"", host_mem=(0, 0, 0), speaks=speaks,
                    tp_size=2, tp_rank=1)  # fmt: skip
    both = r"rank 0 of 1 at DE de0, rank 1 of 2 at PE tcp://.*: DE rank 0 of 1 takes its rows from PE ranks \[0\] of 2"
    client = PeerClient(de.address, 5.0)
    try:
        with pytest.raises(ProtocolError, match=both):
            client.request(hello)
    finally:
        client.close()
    assert not de.worker.dataplane.links


def test_a_pe_rank_pairs_with_each_de_rank_it_is_a_source_of(tp_deploy):
    """GQA 8: PE rank 1 of 2 pairs with DE rank 0 of 1 (one peer), PE rank 0 of 1 with DE ranks 0 and 1 of 2 (a leg
    each, over that DE rank's 4 heads)."""
    down = tp_deploy(2, 1, "gqa", 8)
    peer = down.instances["pe0/1"].worker.prefill.connect_peer(down.instances["de0/0"].address)
    assert (peer.de.size, peer.de.rank) == (1, 0)
    assert m.pair_id("x", down.shard("pe0", 1), peer.de) == "x@1"  # DE rank 0 has two sources
    up = tp_deploy(1, 2, "gqa", 8)
    prefill = up.instances["pe0/0"].worker.prefill
    xfer = XferParams("x", "prefill", ReadPath.PE, up.instances["de0/0"].address, False)
    legs = prefill._legs_of(LoadSpec("p", xfer, 0, 0, 1, [], []))
    assert [(leg.rows.size, leg.rows.rank, leg.layout.num_units) for leg in legs] == [(2, 0, 4), (2, 1, 4)]


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


@pytest.mark.parametrize(("kind", "heads", "pe_tp", "de_tp"), [("mla", 1, 1, 2), ("gqa", 2, 1, 4)], ids=["mla", "gqa2"])
def test_a_receive_its_lead_fails_is_reported_failed_by_every_replica(tp_deploy, kind, heads, pe_tp, de_tp):
    """Replicas on the DE: only a request's lead takes its receive; a second request on a transfer id already in use
    fails on that lead at once, and every rank of its replicas reports it received and failed in the same step (the
    other replica groups, with their own lead, too), nothing written into any cache."""
    d = tp_deploy(pe_tp, de_tp, kind, heads)
    xfer = XferParams("dup", "decode", ReadPath.DE, d.instances["pe0/0"].address, False)
    first, second = (RecvSpec(req, xfer, 0, 8, d.instances["de0/0"].take_blocks(3), 11) for req in ("a", "b"))
    for name in d.ranks("de0"):
        d.expect_recv(name, first)
        d.expect_recv(name, second)
    ends = on_ranks([lambda name=name: d.finish(name, {"b"}) for name in d.ranks("de0")])
    assert ends == [({"b"}, {"b"})] * de_tp
    for rank in range(de_tp):
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected_de_caches([], Model(kind, heads, de_tp, rank)))


@pytest.mark.parametrize("key", ["xa", "xd"])  # lead PE rank 1, then 0
def test_a_load_its_lead_fails_is_recomputed_on_every_replica_bit_exact(tp_deploy, key):
    """MLA, PE 2 / DE 2, PE read path: the request's lead PE rank reads hit block 3 corrupt (blocks 0-2 load, 3 and 4
    are reported); its replica took the lead's rows (what its cache holds) and reported nothing. vLLM recomputes from the first block any rank reported
    (the union over ranks) on every rank: then every PE rank's cache holds the prompt's true rows and every DE rank's
    receive is bit-exact (the lead sends complete layers; the DE's lead copies them to its replica)."""
    d = tp_deploy(2, 2, "mla", 1)
    rows = d.true_rows(3, 23, d.model.full)
    ids = d.store_prefix(rows, 5, 99)
    pe0, de0 = d.instances["pe0/0"], d.instances["de0/0"]
    pe_blocks, de_blocks = pe0.take_blocks(6), de0.take_blocks(6)
    de_req = RecvSpec("d", XferParams(key, "decode", ReadPath.PE, pe0.address, False), 0, 20, de_blocks, 23)
    for name in d.ranks("de0"):
        d.expect_recv(name, de_req)
    xfer = XferParams(key, "prefill", ReadPath.PE, de0.address, False)
    lead = d.shard("pe0", 0).lead(key, 2)
    store = d.instances[f"pe0/{lead}"].worker.store
    getattr(store, "store", store).faults.corrupt_next_read(ids[3])

    def step(name: str, meta: DualPathMetadata, start: int) -> set[int]:
        """One forward of the request on PE rank ``name``: rows from ``start`` computed (written) and saved."""
        inst = d.instances[name]
        inst.worker.start_step(meta)
        for layer, layer_name in enumerate(inst.layer_names()):
            inst.worker.wait_for_layer_load(layer_name)
            inst.adapter.write_tokens(inst.caches[layer], pe_blocks, start, rows[layer, start:])
            inst.worker.save_kv_layer(layer_name, inst.caches[layer])
        inst.worker.wait_for_save()
        return inst.worker.get_block_ids_with_load_errors()

    first = DualPathMetadata(loads=[LoadSpec("p", xfer, 0, 20, 23, ids, pe_blocks)],
                             saves=[SaveSpec("p", xfer, 20, 23, pe_blocks)])  # fmt: skip
    bad = on_ranks([lambda name=name: step(name, first, 20) for name in d.ranks("pe0")])
    assert bad[lead] == set(pe_blocks[3:5]) and bad[1 - lead] == set()  # blocks 0-2 loaded, copied to the replica
    start = min(pe_blocks.index(block) for block in set().union(*bad)) * BLOCK
    again = DualPathMetadata(saves=[SaveSpec("p", xfer, start, 23, pe_blocks)])
    on_ranks([lambda name=name: step(name, again, start) for name in d.ranks("pe0")])
    ends = on_ranks([lambda name=name: d.finish(name, {"d"}) for name in d.ranks("de0")])
    assert ends == [({"d"}, set())] * 2
    for name in d.ranks("pe0"):
        inst = d.instances[name]
        for layer, cache in enumerate(inst.caches):
            assert inst.adapter.read_tokens(cache, pe_blocks, 0, 23).equal(rows[layer]), (name, layer)
    for rank in range(2):
        expected = expected_de_caches([(de_req, rows)], Model("mla", 1, 2, rank))
        assert_caches_equal(d.instances[f"de0/{rank}"].caches, expected)


STATUS_SIZES = [(2, 2), (2, 1), (1, 2), (4, 2), (1, 4)]


@pytest.mark.parametrize(("pe_tp", "de_tp"), STATUS_SIZES, ids=[f"pe{p}-de{d}" for p, d in STATUS_SIZES])
@pytest.mark.parametrize(("kind", "heads"), [("gqa", 8), ("gqa", 2), ("mla", 1)], ids=["gqa8", "gqa2", "mla"])
@pytest.mark.parametrize("path", ["pe", "de"])
def test_an_instances_status_counts_each_request_once_whatever_its_ranks(tp_deploy, pe_tp, de_tp, kind, heads, path):
    """The proxy's view of an instance, its ranks' statuses merged (``messages.instance_status``): a request read
    ahead and not yet stepped is one unfinished request of its prompt's tokens on each instance, whether every rank
    moves its heads of it (GQA) or only its lead (MLA, replicated heads); once it ended, nothing is unfinished or
    held, and the instance read one copy of the hit KV and counts each hit block once (a PE rank reading through
    legs, or a DE rank for several PE ranks, reads each pair's share of a block apart: one of them counts it)."""
    d = tp_deploy(pe_tp, de_tp, kind, heads)
    seen = {}

    def merged(name: str) -> m.Status:
        return m.instance_status([d.instances[rank].worker.status() for rank in d.ranks(name)])

    def before_step() -> None:
        seen.update({name: merged(name) for name in ("pe0", "de0")})

    d.run("pe0", "de0", 23, 5, path, False, seed=3, ahead=True, before_step=before_step)
    for name, status in seen.items():
        assert (status.unfinished_requests, status.unfinished_tokens) == (1, 23), (name, status)
        assert status.tp_size == d.tp[name]
    after = {name: merged(name) for name in ("pe0", "de0")}
    assert [(s.unfinished_requests, s.host_leases, s.read_queue_tokens) for s in after.values()] == [(0, 0, 0)] * 2
    reader = after["pe0" if path == "pe" else "de0"]
    assert (reader.snic_read_bytes, reader.snic_read_blocks) == (5 * d.model.full.full_block_bytes, 5)
