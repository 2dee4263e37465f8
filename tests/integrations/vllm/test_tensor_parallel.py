"""Tensor parallelism of equal size on both sides, on the real connector workers (no vLLM).

:class:`~tests.integrations.vllm.worker_harness.TpDeployment`: one PE and one DE of ``tp`` ranks each, PE rank ``r``
paired with DE rank ``r``, every worker holding its rank's heads (GQA) or the whole latent (MLA) and reading only its
byte ranges of the stored full blocks. The DE caches are checked bit for bit per rank (poisoned bytes nobody may
write stay), and the storage NICs' accounting against one copy of the hit KV.
"""

from __future__ import annotations

import os

import pytest

from ascend_dualpath.dualpath.dataplane import SHM_DIR
from tests.integrations.vllm.worker_harness import TpDeployment, assert_caches_equal, expected_de_caches

PATHS = [("pe", False), ("de", False), ("de", True)]
MODELS = [("gqa", 4), ("gqa", 8), ("gqa", 2), ("mla", 1)]


@pytest.fixture
def tp_deploy(tmp_path):
    made = []

    def make(*args, **kwargs):
        made.append(TpDeployment(tmp_path / f"store{len(made)}", *args, **kwargs))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"adp.{deployment.fabric}")]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("kind", "kv_heads"), MODELS, ids=[f"{k}{h}" for k, h in MODELS])
def test_every_rank_moves_its_share_on_every_path_bit_exact(tp_deploy, tp, kind, kv_heads):
    if kind == "gqa" and kv_heads < tp and tp != 4:
        pytest.skip("replicated heads: one case (2 heads over 4 ranks) is enough")
    d = tp_deploy(1, 1, tp, kind, kv_heads)
    written = [[] for _ in range(tp)]
    hit_blocks, full = 5, d.model.full.full_block_bytes
    # a GQA head is read once per instance pair (by each rank that holds it when heads are replicated); MLA's latent,
    # which every rank holds, is read by every rank (not yet once per instance)
    copies = tp if kind == "mla" else max(1, tp // kv_heads)
    for i, (path, split) in enumerate(PATHS):
        before = {name: d.bytes_read(name) for name in ("pe0", "de0")}
        for rank, (de_req, rows) in enumerate(d.run("pe0", "de0", 23 + i, hit_blocks, path, split, seed=7 * i)):
            written[rank].append((de_req, rows))
        read = {name: d.bytes_read(name) - before[name] for name in before}
        assert read["pe0"] + read["de0"] == copies * hit_blocks * full, (path, split, read)
        if not split:  # the path's side alone reads
            assert read["de0" if path == "pe" else "pe0"] == 0, (path, read)
    for deployment, rank_written in zip(d.ranks, written, strict=True):
        expected = expected_de_caches(rank_written, deployment.model)
        assert_caches_equal(deployment.instances["de0"].caches, expected)
        status = deployment.instances["pe0"].status()
        assert (status["loads_pe"], status["loads_de"], status["loads_split"]) == (1, 1, 1)
        assert status["fallbacks"] == status["failures"] == 0
