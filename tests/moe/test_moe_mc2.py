"""The ``mc2`` strategy against the op-plugin docs' tables, on the CPU with a fake ``torch_npu`` module.

Nothing here runs an MC2 op: the fake records the calls, the tables are the documented limits (see the module
docstring of ``ascend_dualpath.moe.strategies.mc2``).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from ascend_dualpath.dualpath.traffic import QosPolicy
from ascend_dualpath.errors import BackendUnavailable, BoundsError, CapacityError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe.strategies import mc2

NO_PCIE = {}  # an environment without HCCL_INTRA_* (A2 "" resolves to fullmesh)
INTRA_PCIE = {"HCCL_INTRA_PCIE_ENABLE": "1", "HCCL_INTRA_ROCE_ENABLE": "0"}


def _inputs(tokens=8, hidden=7168, topk=8, experts=256):
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(tokens * 131 + topk)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int()
    return x, ids


# ---- comm_alg resolution ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, product, comm_alg, env, op, resolved",
    [
        ("v1", "A2", "", NO_PCIE, "dispatch", "fullmesh"),
        ("v1", "A2", "", INTRA_PCIE, "dispatch", "hierarchy"),
        ("v1", "A3", "", INTRA_PCIE, "dispatch", "fullmesh_v1"),
        ("v2", "A2", "", NO_PCIE, "dispatch", "fullmesh"),
        ("v2", "A2", "", INTRA_PCIE, "dispatch", "hierarchy"),
        ("v2", "A2", "hierarchy", NO_PCIE, "combine", "hierarchy"),
        ("v2", "A3", "", NO_PCIE, "dispatch", "fullmesh_v1"),
        ("v2", "A3", "fullmesh_v2", NO_PCIE, "dispatch", "fullmesh_v2"),
        ("v2", "A3", "hierarchy", NO_PCIE, "combine", "hierarchy"),
    ],
)
def test_comm_alg_resolves_as_documented(version, product, comm_alg, env, op, resolved):
    assert mc2.resolve_comm_alg(version, product, comm_alg, env, op) == resolved


@pytest.mark.parametrize(
    "version, product, comm_alg, op, words",
    [
        ("v1", "A2", "hierarchy", "dispatch", "v1 ops take no comm_alg"),
        ("v2", "A2", "fullmesh_v2", "dispatch", "not accepted by dispatch_v2 on A2"),
        ("v2", "A3", "fullmesh", "dispatch", "not accepted by dispatch_v2 on A3"),
        ("v2", "A3", "fullmesh_v2", "combine", "not accepted by combine_v2 on A3"),
        ("v2", "A1", "", "dispatch", "product='A1'"),
        ("v3", "A3", "", "dispatch", "version='v3'"),
    ],
)
def test_comm_alg_refusals_name_the_value(version, product, comm_alg, op, words):
    with pytest.raises(ConfigError, match=words):
        mc2.resolve_comm_alg(version, product, comm_alg, NO_PCIE, op)


# ---- the limits table: one accepted call at each documented edge, one refused just past it -------------------

# (version, product, comm_alg, env, accepted shape, (changed field, value past the edge), error, words)
EDGES = [
    # tokens per rank by product and comm_alg
    ("v1", "A2", "", NO_PCIE, dict(tokens=256, world=16, experts=256), ("tokens", 257), PayloadTooLarge, "1 to 256"),
    ("v1", "A3", "", NO_PCIE, dict(tokens=512, world=16, experts=256), ("tokens", 513), PayloadTooLarge, "1 to 512"),
    (
        "v2",
        "A2",
        "fullmesh",
        NO_PCIE,
        dict(tokens=256, world=16, experts=256),
        ("tokens", 257),
        PayloadTooLarge,
        "1 to 256",
    ),
    (
        "v2",
        "A2",
        "hierarchy",
        NO_PCIE,
        dict(tokens=512, world=16, experts=256),
        ("tokens", 513),
        PayloadTooLarge,
        "1 to 512",
    ),
    ("v2", "A3", "", NO_PCIE, dict(tokens=512, hidden=4096), ("tokens", 513), PayloadTooLarge, "1 to 512"),
    ("v2", "A3", "fullmesh_v2", NO_PCIE, dict(tokens=256, hidden=4096), ("tokens", 257), PayloadTooLarge, "1 to 256"),
    ("v2", "A3", "hierarchy", NO_PCIE, dict(tokens=256, hidden=4096), ("tokens", 257), PayloadTooLarge, "1 to 256"),
    # top-k
    ("v1", "A3", "", NO_PCIE, dict(topk=8), ("topk", 9), ConfigError, r"top-k in \[1, 8\]"),
    ("v1", "A2", "", NO_PCIE, dict(topk=16, world=16, experts=256), ("topk", 17), ConfigError, r"\[1, 16\]"),
    ("v2", "A3", "", NO_PCIE, dict(topk=16, hidden=4096), ("topk", 17), ConfigError, r"\[1, 16\]"),
    ("v2", "A3", "fullmesh_v2", NO_PCIE, dict(topk=12, hidden=4096), ("topk", 13), ConfigError, r"\[1, 12\]"),
    # hidden: v1 A3 only 7168; v2 A3 [1024, 8192]; A2 a multiple of 32 up to 7168 (fullmesh) or 10240 (hierarchy)
    ("v1", "A3", "", NO_PCIE, dict(hidden=7168), ("hidden", 4096), ConfigError, "hidden == 7168"),
    (
        "v1",
        "A2",
        "",
        NO_PCIE,
        dict(hidden=7168, world=16, experts=256),
        ("hidden", 7200),
        ConfigError,
        r"\[1, 7168\], a multiple of 32",
    ),
    ("v2", "A3", "", NO_PCIE, dict(hidden=8192), ("hidden", 8224), ConfigError, r"\[1024, 8192\]"),
    ("v2", "A3", "", NO_PCIE, dict(hidden=1024), ("hidden", 992), ConfigError, r"\[1024, 8192\]"),
    (
        "v2",
        "A2",
        "fullmesh",
        NO_PCIE,
        dict(hidden=512, world=16, experts=256),
        ("hidden", 7200),
        ConfigError,
        r"\[1, 7168\]",
    ),
    (
        "v2",
        "A2",
        "fullmesh",
        NO_PCIE,
        dict(hidden=512, world=16, experts=256),
        ("hidden", 528),
        ConfigError,
        "multiple of 32",
    ),
    (
        "v2",
        "A2",
        "hierarchy",
        NO_PCIE,
        dict(hidden=10240, world=16, experts=256),
        ("hidden", 10272),
        ConfigError,
        r"\[1, 10240\]",
    ),
    # ep_world_size sets
    ("v1", "A2", "", NO_PCIE, dict(world=64, experts=256), ("world", 8), ConfigError, "16, 32, 64"),
    (
        "v1",
        "A3",
        "",
        NO_PCIE,
        dict(world=288, experts=288),
        ("world", 96),
        ConfigError,
        "8, 16, 32, 64, 128, 144, 256, 288",
    ),
    ("v2", "A2", "fullmesh", NO_PCIE, dict(world=8, experts=64), ("world", 12), ConfigError, "2, 3, 4, 5, 6, 7, 8"),
    ("v2", "A2", "hierarchy", NO_PCIE, dict(world=16, experts=256), ("world", 8), ConfigError, "16, 32, 64"),
    ("v2", "A3", "", NO_PCIE, dict(world=768, experts=768, hidden=4096), ("world", 769), ConfigError, "2..768"),
    ("v2", "A3", "hierarchy", NO_PCIE, dict(world=32, experts=256, hidden=4096), ("world", 24), ConfigError, "16..256"),
    # experts: 512 (v1, A3 hierarchy) or 1024 (v2); a multiple of the expert ranks
    ("v1", "A3", "", NO_PCIE, dict(experts=512, world=16), ("experts", 528), ConfigError, r"\[1, 512\]"),
    (
        "v2",
        "A3",
        "",
        NO_PCIE,
        dict(experts=1024, world=16, hidden=4096),
        ("experts", 1040),
        ConfigError,
        r"\[1, 1024\]",
    ),
    (
        "v2",
        "A3",
        "hierarchy",
        NO_PCIE,
        dict(experts=512, world=16, hidden=4096),
        ("experts", 528),
        ConfigError,
        r"\[1, 512\]",
    ),
    ("v2", "A3", "", NO_PCIE, dict(experts=256, world=16, hidden=4096), ("experts", 250), ConfigError, "a multiple of"),
    # the A2 local-expert rule: v1 fullmesh only (not v1 under HCCL_INTRA_PCIE, not v2)
    ("v1", "A2", "", NO_PCIE, dict(experts=384, world=16), ("experts", 400), ConfigError, "<= 24 local experts"),
    ("v1", "A2", "", INTRA_PCIE, dict(experts=512, world=16), ("experts", 528), ConfigError, r"\[1, 512\]"),
    ("v2", "A2", "fullmesh", NO_PCIE, dict(experts=1024, world=16), ("experts", 1040), ConfigError, r"\[1, 1024\]"),
    # A3 v2: local experts x ep_world_size <= 2048 (only shared-expert ranks can make it exceed E)
    (
        "v2",
        "A3",
        "",
        NO_PCIE,
        dict(experts=1024, world=48, hidden=4096, shared_expert_rank_num=16),
        ("shared_expert_rank_num", 32),
        ConfigError,
        "<= 2048, got 64 x 48",
    ),
]


def _dispatch(version, product, comm_alg, env, tokens=8, hidden=7168, topk=8, experts=256, world=16, **options):
    x, ids = _inputs(tokens, hidden, topk, experts)
    return mc2.validate_dispatch(
        x, ids, world, 0, experts, product=product, version=version, comm_alg=comm_alg, env=env, **options
    )


@pytest.mark.parametrize(
    "version, product, comm_alg, env, shape, past, error, words",
    EDGES,
    ids=[f"{e[0]}-{e[1]}-{e[2] or 'default'}-{e[5][0]}={e[5][1]}" for e in EDGES],
)
def test_dispatch_limits_by_product_and_comm_alg(version, product, comm_alg, env, shape, past, error, words):
    _dispatch(version, product, comm_alg, env, **shape)
    with pytest.raises(error, match=words):
        _dispatch(version, product, comm_alg, env, **{**shape, past[0]: past[1]})


@pytest.mark.parametrize(
    "version, product, comm_alg, hidden, ok",
    [
        ("v2", "A3", "", 8192, True),  # combine_v2 on A3 takes [1024, 8192] now (7168 was the old limit)
        ("v2", "A3", "", 992, False),
        ("v2", "A2", "fullmesh", 7168, True),
        ("v2", "A2", "fullmesh", 7200, False),
        ("v2", "A2", "hierarchy", 10240, True),
        ("v1", "A3", "", 4096, False),
    ],
)
def test_combine_hidden_ranges_per_product(version, product, comm_alg, hidden, ok):
    _, ids = _inputs(8, hidden, 8, 256)
    args = (torch.zeros(64, hidden, dtype=torch.bfloat16), ids, torch.ones(ids.shape), 16, 0, 256)
    kwargs = dict(product=product, version=version, comm_alg=comm_alg, env=NO_PCIE)
    if ok:
        mc2.validate_combine(*args, **kwargs)
    else:
        with pytest.raises(ConfigError, match="hidden"):
            mc2.validate_combine(*args, **kwargs)


# ---- x_active_mask, ids, dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, product, comm_alg, dims",
    [
        ("v1", "A3", "", ()),
        ("v1", "A2", "", ()),
        ("v2", "A2", "fullmesh", (1, 2)),
        ("v2", "A2", "hierarchy", ()),
        ("v2", "A3", "", (1, 2)),
        ("v2", "A3", "hierarchy", (1,)),
    ],
)
def test_active_mask_ranks_per_product_and_comm_alg(version, product, comm_alg, dims):
    shape = dict(world=16, experts=256, hidden=4096 if product == "A3" and version == "v2" else 7168)
    masks = {1: torch.ones(8, dtype=torch.bool), 2: torch.ones(8, 8, dtype=torch.bool)}
    for dim, mask in masks.items():
        if dim in dims:
            _dispatch(version, product, comm_alg, NO_PCIE, x_active_mask=mask, **shape)
        else:
            with pytest.raises(ConfigError, match="x_active_mask"):
                _dispatch(version, product, comm_alg, NO_PCIE, x_active_mask=mask, **shape)


def test_ids_out_of_range_or_repeated_are_refused_unless_masked():
    x, ids = _inputs()
    run = lambda ids, **kw: mc2.validate_dispatch(x, ids, 16, 0, 256, env=NO_PCIE, **kw)  # noqa: E731
    bad = ids.clone()
    bad[0, 0] = 256
    with pytest.raises(BoundsError, match="256"):
        run(bad)
    bad[0, 0] = -1
    with pytest.raises(BoundsError, match="-1"):
        run(bad)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[0, 0] = False
    run(bad, x_active_mask=mask)
    dup = ids.clone()
    dup[1, 1] = dup[1, 0]
    with pytest.raises(ConfigError, match="repeat"):
        run(dup)
    with pytest.raises(ConfigError, match="prefix"):
        run(ids, x_active_mask=torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]).bool())
    with pytest.raises(ConfigError, match="quant_mode=1"):
        run(ids, quant_mode=1)
    with pytest.raises(ConfigError, match="bf16/fp16"):
        mc2.validate_dispatch(x.float(), ids, 16, 0, 256, env=NO_PCIE)


# ---- HCCL_BUFFSIZE --------------------------------------------------------------------------------------------

# (version, product, comm_alg, BS, H, K, E, R, MB): each value worked by hand from the docs' formula
BUFFSIZE = [
    # A2 fullmesh: 2 * (BS*R*min(L,K)*H*2 + 2 MB) = 2 * (14 MB + 2 MB) = 32 MB
    ("v1", "A2", "fullmesh", 8, 7168, 8, 256, 16, 32),
    ("v2", "A2", "fullmesh", 8, 7168, 8, 256, 16, 32),
    # v1 A2 under HCCL_INTRA_PCIE: E*BS*(H*2 + 4*Align8(K)*4) + 104 MB = 256*8*(14336+128) B + 104 MB -> 133
    ("v1", "A2", "hierarchy", 8, 7168, 8, 256, 16, 133),
    # v2 A2 hierarchy: (E + R/4) * Align512(BS*(H*2 + 128)) + 8 MB = 260 * 115712 B + 8 MB = 36.69 MB -> 37
    ("v2", "A2", "hierarchy", 8, 7168, 8, 256, 16, 37),
    # v1 A3: 2 + ceil(2*BS*2*(H+128)*(R*L+K+1) / MB) = 2 + ceil(2*8*2*7296*265 B / MB = 59.004) = 2 + 60 -> 62
    ("v1", "A3", "fullmesh_v1", 8, 7168, 8, 256, 16, 62),
    # v2 A3 fullmesh_v1: 2*(L*BS*R*Align512(Align32(2H)+64) + (K+1)*BS*Align512(2H))
    #   = 2*(16*8*16*14848 + 9*8*14336) B = 59.97 MB -> 60
    ("v2", "A3", "fullmesh_v1", 8, 7168, 8, 256, 16, 60),
    # fullmesh_v2: 480Align512(14400) = 30 * 512 = 15360 -> 2*(16*8*16*15360 + 9*8*14336) B = 61.97 MB -> 62
    ("v2", "A3", "fullmesh_v2", 8, 7168, 8, 256, 16, 62),
    # v2 A3 hierarchy: E*BS*(H*2+128) + 404 MB = 256*8*14464 B + 404 MB = 432.25 MB -> 433
    ("v2", "A3", "hierarchy", 8, 7168, 8, 256, 16, 433),
]


@pytest.mark.parametrize(
    "version, product, comm_alg, bs, hidden, topk, experts, world, expected",
    BUFFSIZE,
    ids=[f"{b[0]}-{b[1]}-{b[2]}" for b in BUFFSIZE],
)
def test_hccl_buffsize_formulas(version, product, comm_alg, bs, hidden, topk, experts, world, expected):
    got = mc2.required_hccl_buffsize_mb(
        version, product, comm_alg, max_tokens=bs, hidden=hidden, topk=topk, moe_expert_num=experts, ep_world_size=world
    )
    assert got == expected


def test_hccl_buffsize_env_and_check():
    assert mc2.hccl_buffsize_mb({}) == 200
    assert mc2.hccl_buffsize_mb({"HCCL_BUFFSIZE": "512"}) == 512
    with pytest.raises(ConfigError, match="HCCL_BUFFSIZE='2x'"):
        mc2.hccl_buffsize_mb({"HCCL_BUFFSIZE": "2x"})
    mc2.check_hccl_buffsize(200, 200, "op")
    with pytest.raises(CapacityError, match="HCCL_BUFFSIZE >= 433 MB .* 200 MB"):
        mc2.check_hccl_buffsize(433, 200, "op")


# ---- the strategy over a fake torch_npu -----------------------------------------------------------------------


class _FakeHcclOptions:
    """``ProcessGroupHCCL.Options`` as torch_npu binds it: reading ``hccl_config`` returns a copy."""

    def __init__(self):
        self._config = {}

    @property
    def hccl_config(self):
        return dict(self._config)

    @hccl_config.setter
    def hccl_config(self, value):
        self._config = dict(value)


class _FakeNpu(types.ModuleType):
    """Records every MC2 call; ``versions`` says which op pairs exist."""

    def __init__(self, versions=("v1", "v2"), soc_version=253):
        super().__init__("torch_npu")
        self.calls = []
        self.npu = types.SimpleNamespace(get_soc_version=lambda: soc_version)
        hccl = types.SimpleNamespace(Options=_FakeHcclOptions)
        self._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(ProcessGroupHCCL=hccl))
        for version, suffix in (("v1", ""), ("v2", "_v2")):
            if version in versions:
                for op in ("dispatch", "combine"):
                    name = f"npu_moe_distribute_{op}{suffix}"
                    setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def op(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return (name,)

        return op


class _FakeGroup:
    def __init__(self, name):
        self.name = name

    def _get_backend(self, device):
        assert device.type == torch._C._get_privateuse1_backend_name()
        return types.SimpleNamespace(get_hccl_comm_name=lambda rank: f"{self.name}-comm-{rank}")


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed answering for one hccl group of 16 ranks; records groups made and collectives run."""
    made, collectives, options = [], [], []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 16)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: list(range(16)))

    def new_group(ranks, backend=None, use_local_synchronization=False, pg_options=None):
        made.append((tuple(ranks), backend, use_local_synchronization))
        options.append(pg_options)
        return _FakeGroup("fallback")

    class _Done:
        def is_completed(self):
            return True

        def wait(self):
            return True

    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        collectives.append(group)
        out.copy_(inp)
        return _Done()

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    return types.SimpleNamespace(made=made, collectives=collectives, options=options)


def _strategy(monkeypatch, versions=("v1", "v2"), soc_version=253, **options):
    fake = _FakeNpu(versions, soc_version)
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", fake)
    return fake, mc2.Mc2Strategy(_FakeGroup("ep"), 5.0, **options)


def test_fallback_all_to_all_runs_on_its_own_group(monkeypatch, fake_dist):
    fake, strategy = _strategy(monkeypatch)
    assert fake_dist.made == [(tuple(range(16)), "hccl", True)]
    assert strategy.group.name == "fallback" and strategy.mc2_group.name == "ep"
    assert strategy.group_name == "ep-comm-0"
    rows = torch.arange(16, dtype=torch.int32).reshape(16, 1)
    strategy.exchange_rows([rows], [1] * 16, [1] * 16, "test rows").wait()
    assert [g.name for g in fake_dist.collectives] == ["fallback"]


def test_fallback_group_is_in_the_model_traffic_class(monkeypatch, fake_dist):
    """The all-to-all group the strategy makes carries model traffic: its pg_options hold the high class's
    ``qos_traffic_class`` / ``qos_service_level`` (HCCL's defaults, 132 / 4), never KV's (96 / 3)."""
    _strategy(monkeypatch)
    (options,) = fake_dist.options
    model = QosPolicy().model
    assert options.hccl_config == {"qos_traffic_class": model.traffic_class, "qos_service_level": model.service_level}


def test_the_mc2_group_is_refused_as_fallback(monkeypatch, fake_dist):
    group = _FakeGroup("ep")
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", _FakeNpu())
    with pytest.raises(ConfigError, match="its own process group"):
        mc2.Mc2Strategy(group, 5.0, fallback_group=group)


@pytest.mark.parametrize(
    "versions, requested, used",
    [
        (("v1", "v2"), "auto", "v2"),
        (("v1",), "auto", "v1"),
        (("v2",), "auto", "v2"),
        (("v1", "v2"), "v1", "v1"),
    ],
)
def test_v2_where_present_else_v1(monkeypatch, fake_dist, versions, requested, used):
    fake, strategy = _strategy(monkeypatch, versions, version=requested, product="A3")
    assert strategy.version == used
    x, ids = _inputs()
    strategy.dispatch_expanded(x, ids, 256, quant_mode=2)
    expand = torch.zeros(64, 7168, dtype=torch.bfloat16)
    strategy.combine_expanded(expand, ids, "assist", "counts", torch.ones(ids.shape), 256)
    suffix = "_v2" if used == "v2" else ""
    assert [c[0] for c in fake.calls] == [f"npu_moe_distribute_dispatch{suffix}", f"npu_moe_distribute_combine{suffix}"]
    dispatch_kwargs = fake.calls[0][2]
    assert ("comm_alg" in dispatch_kwargs) == (used == "v2")  # v1 takes no comm_alg
    assert fake.calls[0][1][2:6] == ("ep-comm-0", 16, 0, 256)


@pytest.mark.parametrize(
    "versions, requested, words",
    [
        ((), "auto", "neither"),
        (("v1",), "v2", "lacks npu_moe_distribute_dispatch_v2"),
        (("v2",), "v1", "lacks npu_moe_distribute_dispatch or"),
    ],
)
def test_missing_ops_are_unavailable_with_the_name(monkeypatch, fake_dist, versions, requested, words):
    with pytest.raises(BackendUnavailable, match=words):
        _strategy(monkeypatch, versions, version=requested)


def test_a3_fullmesh_v2_dispatch_pairs_with_the_default_combine(monkeypatch, fake_dist):
    fake, strategy = _strategy(monkeypatch, comm_alg="fullmesh_v2", product="A3")
    x, ids = _inputs(hidden=4096)
    strategy.dispatch_expanded(x, ids, 256)
    strategy.combine_expanded(torch.zeros(64, 4096, dtype=torch.bfloat16), ids, "a", "c", torch.ones(ids.shape), 256)
    assert fake.calls[0][2]["comm_alg"] == "fullmesh_v2" and fake.calls[1][2]["comm_alg"] == ""


def test_buffer_too_small_is_refused_before_the_op(monkeypatch, fake_dist):
    fake, strategy = _strategy(monkeypatch, product="A3", comm_alg="hierarchy", hccl_buffsize_mb=200)
    x, ids = _inputs(hidden=7168)
    with pytest.raises(CapacityError, match="HCCL_BUFFSIZE >= 433 MB"):
        strategy.dispatch_expanded(x, ids, 256)
    assert fake.calls == []
    monkeypatch.setenv("HCCL_BUFFSIZE", "433")
    strategy.hccl_buffsize_mb = None
    strategy.dispatch_expanded(x, ids, 256)
    assert len(fake.calls) == 1


@pytest.mark.parametrize("soc_version, product", [(220, "A2"), (224, "A2"), (250, "A3"), (255, "A3")])
def test_product_from_the_soc_version(monkeypatch, fake_dist, soc_version, product):
    _, strategy = _strategy(monkeypatch, soc_version=soc_version)
    assert strategy.product == product


def test_an_unknown_soc_needs_an_explicit_product(monkeypatch, fake_dist):
    with pytest.raises(ConfigError, match="SoC version 202 is neither Atlas A2"):
        _strategy(monkeypatch, soc_version=202)
    _, strategy = _strategy(monkeypatch, soc_version=202, product="A2")
    assert strategy.product == "A2"


def test_invalid_call_never_reaches_the_op(monkeypatch, fake_dist):
    fake, strategy = _strategy(monkeypatch, product="A2", comm_alg="fullmesh")
    x, ids = _inputs(tokens=300)
    with pytest.raises(PayloadTooLarge, match="1 to 256"):
        strategy.dispatch_expanded(x, ids, 256)
    assert fake.calls == []
