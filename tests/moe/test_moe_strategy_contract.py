"""The strategy contract (moe/strategies/base.py): abstract exchanges, the defaults built on them, no stray hooks."""

from __future__ import annotations

import inspect
import tempfile

import pytest
import torch

from ascend_dualpath.errors import ArgumentTypeError, BoundsError, ConfigError, WaitTimeout
from ascend_dualpath.moe import Config
from ascend_dualpath.moe.layout import compute_dispatch_layout
from ascend_dualpath.moe.strategies import aiv, alltoall, base, cuda, mc2
from ascend_dualpath.moe.strategies.base import NormalPlan, PendingRows, Strategy

# Public methods a registered strategy defines besides the contract: its own documented API.
OWN_API = {
    "AllToAllStrategy": set(),
    "AivStrategy": {"dataplane", "hierarchy", "magic"},
    "CudaStrategy": {"config_of", "count_epoch", "data_epoch", "generation", "layout_range", "num_sms_for"},
    "Mc2Strategy": {"combine_expanded", "dispatch_expanded"},
}


class OneRank(Strategy):
    """The smallest strategy: one rank, the exchanges hand back what was sent."""

    name = "one-rank"

    def exchange_counts(self, counts, what):
        return counts.to(torch.int64).view(1, -1).cpu()

    def exchange_rows(self, parts, send_counts, recv_counts, what):
        assert list(send_counts) == list(recv_counts) == [parts[0].shape[0]]
        return PendingRows(lambda timeout_s: [p.clone() for p in parts], self.timeout_s)


def test_the_two_exchanges_are_required():
    class NoRows(Strategy):
        def exchange_counts(self, counts, what):
            return counts

    with pytest.raises(TypeError, match="exchange_rows"):
        NoRows(None, 1.0)
    assert Strategy.__abstractmethods__ == {"exchange_counts", "exchange_rows"}


def test_registered_strategies_define_no_stray_public_methods():
    """A misspelt override (``localise_topk``) would be a public name outside the contract: listed here or an error."""
    classes = {
        cls.__name__: cls
        for module in (alltoall, aiv, cuda, mc2)
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, Strategy) and cls.__module__ == module.__name__
    }
    assert set(classes) == set(OWN_API)
    for name, cls in classes.items():
        extra = {n for n in vars(cls) if not n.startswith("_") and n not in vars(Strategy)}
        assert extra == OWN_API[name], (name, extra ^ OWN_API[name])


def test_pending_rows_wait_takes_the_transport_bound():
    """``wait(timeout_s=None)``: None hands ``finish`` the strategy's bound, a given bound is checked as the
    transport checks it (0 allowed; NaN, infinities, negatives and bools refused before ``finish`` runs), a wait that
    timed out can be repeated, and the parts are kept once received."""
    rows = [torch.arange(4)]
    bounds = []
    outcomes = iter([WaitTimeout("not yet"), rows])

    def finish(timeout_s):
        bounds.append(timeout_s)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    pending = PendingRows(finish, 7.0)
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ConfigError, match=f"PendingRows.wait: timeout_s must be .*>= 0, got {bad}"):
            pending.wait(bad)
    with pytest.raises(ArgumentTypeError, match="timeout_s"):
        pending.wait(True)
    assert bounds == []
    with pytest.raises(WaitTimeout, match="not yet"):
        pending.wait(0)
    assert pending.wait() is rows and bounds == [0.0, 7.0]
    assert pending.wait(2.5) is rows and bounds == [0.0, 7.0]  # received: no second exchange


def test_defaults_layout_checks_ids_before_counting():
    strategy = OneRank(None, 1.0)
    idx = torch.tensor([[0, 3], [2, -1], [1, 1]])
    layout, id_range = strategy.dispatch_layout(idx, 4, 2, 8)
    assert id_range is None  # checked by the default itself
    for got, want in zip(layout, compute_dispatch_layout(idx, 4, 2, 8), strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    with pytest.raises(BoundsError, match="expert id 4"):
        strategy.dispatch_layout(torch.tensor([[0, 4]]), 4, 2, 8)
    with pytest.raises(BoundsError, match="expert id -2"):
        strategy.dispatch_layout(torch.tensor([[-2, 0]]), 4, 2, 8)


def test_defaults_small_hooks():
    strategy = OneRank(None, 1.0)
    assert strategy.graph_capturable is False
    assert strategy.close() is None
    assert torch.equal(strategy.source_index(5, torch.device("cpu")), torch.arange(5, dtype=torch.int32))
    ids = torch.tensor([[0, 5, -1], [7, 4, 6]])
    weights = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    local_ids, local_weights = strategy.localize_topk(ids, weights, rank=1, local_experts=4)
    assert local_ids.tolist() == [[-1, 1, -1], [3, 0, 2]]
    assert torch.equal(local_weights, torch.tensor([[0.0, 0.2, 0.0], [0.4, 0.5, 0.6]]))
    assert ids.tolist() == [[0, 5, -1], [7, 4, 6]], "the default leaves its inputs alone"


def test_defaults_count_exchange_dispatch_and_combine_on_one_rank():
    strategy = OneRank(None, 1.0)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]])
    per_rank, _, per_expert, in_rank = compute_dispatch_layout(idx, 2, 1, 8)
    table = strategy.exchange_dispatch_counts(per_rank, per_expert, idx, in_rank, "counts")
    # per-rank counts [R], per-expert [E], min id, max id, per-rank sum, set entries of is_token_in_rank
    assert table.tolist() == [[2, 1, 2, -1, 1, 2, 2]]
    plan = NormalPlan(0, in_rank, table[:, :1], private={"config": Config()})
    assert strategy.prepare_plan(plan) is None and plan.private == {"config": Config()}
    x = torch.arange(3 * 16, dtype=torch.float32).view(3, 16).to(torch.bfloat16)
    recv = strategy.dispatch_rows(plan, [x, strategy.source_index(3, x.device)], "rows")
    assert torch.equal(recv[0], x[:2]) and recv[1].tolist() == [0, 1]
    bias = torch.ones(3, 16, dtype=torch.bfloat16)
    combined, combined_weights = strategy.combine_rows(plan, recv[0], torch.ones(2, 2), (bias, None))
    assert torch.equal(combined[:2], (x[:2].float() + 1).to(torch.bfloat16)) and torch.equal(combined[2], bias[2])
    assert combined_weights[:2].tolist() == [[1.0, 1.0], [1.0, 1.0]] and combined_weights[2].tolist() == [0.0, 0.0]


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method="file://" + tempfile.mktemp(prefix="adp_contract_"), rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_defaults_low_latency_round_trip(world_of_one):
    """The host low-latency default: a dispatch places each (token, expert) message; the combine of the received
    rows, unchanged, is the weighted sum of the token's own row over its valid slots."""
    strategy = OneRank(world_of_one, 1.0)
    max_tokens, experts, hidden = 4, 2, 128
    x = torch.randn(3, hidden).to(torch.bfloat16)
    idx = torch.tensor([[1, 0], [1, -1], [-1, -1]])
    weights = torch.tensor([[0.25, 0.5], [1.0, 3.0], [2.0, 2.0]])
    recv_x, count, src_info, layout_range, receive = strategy.ll_dispatch(
        x, idx, max_tokens, experts, False, False, False, None, True
    )
    assert count.tolist() == [0, 0], "deferred: nothing placed before the receive half"
    receive()
    assert count.tolist() == [1, 2] and src_info[0, :1].tolist() == [0] and src_info[1, :2].tolist() == [0, 1]
    assert torch.equal(recv_x[1, :2], x[:2]) and torch.equal(recv_x[0, 0], x[0])
    assert layout_range.tolist() == [[1], [2]]  # begin 0 << 32 | count
    out = torch.empty(3, hidden, dtype=torch.bfloat16)
    finish = strategy.ll_combine(recv_x, idx, weights, layout_range, max_tokens, experts, out, True)
    finish()
    want = torch.stack([0.75 * x[0].float(), 1.0 * x[1].float(), torch.zeros(hidden)]).to(torch.bfloat16)
    assert torch.equal(out, want)


def test_base_module_names_every_contract_method_in_its_table():
    documented = base.__doc__
    for name in (
        "exchange_counts",
        "exchange_rows",
        "exchange_dispatch_counts",
        "dispatch_layout",
        "prepare_plan",
        "source_index",
        "dispatch_rows",
        "localize_topk",
        "combine_rows",
        "ll_dispatch",
        "ll_combine",
        "close",
        "graph_capturable",
    ):
        assert name in documented and hasattr(Strategy, name), name
