from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import BoundsError, ConfigError
from ascend_dualpath.kv import LocalBlockStore, ManualClock, ReadQueue, block_hashes, de_buffer
from ascend_dualpath.models import TinyLlama, TinyLlamaConfig

BLOCK_TOKENS = 16
# Largest |logit - float64 reference| allowed; logits have std ~1 and max |logit| ~4 with the seeded weights.
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}
# Cached vs full-recompute logits in the same dtype: same arithmetic on the new tokens' rows.
SAME_DTYPE_ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.05}
DTYPES = [torch.float32, torch.bfloat16]


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed))


def cache_prefix_in_store(model: TinyLlama, store: LocalBlockStore, tokens: torch.Tensor) -> list[bytes]:
    """First turn: full prefill, then persist the whole blocks of its KV (as a decode engine would)."""
    layout = store.layout
    _, kv = model.forward(tokens)
    whole = (len(tokens) // BLOCK_TOKENS) * BLOCK_TOKENS
    blocks = layout.full_blocks_from_layers([layout.encode_rows(kv=layer_kv[:whole]) for layer_kv in kv])
    ids = block_hashes(tokens, BLOCK_TOKENS, namespace=layout.fingerprint())
    parent = None
    for block_id, block in zip(ids, blocks, strict=True):
        store.write_block(block_id, parent, block)
        parent = block_id
    return ids


def load_hit_kv(store: LocalBlockStore, tokens: torch.Tensor, request_id: str):
    """Second turn: longest cached prefix -> read its Full Blocks into a DE buffer -> per-layer hit KV."""
    layout = store.layout
    ids = block_hashes(tokens, BLOCK_TOKENS, namespace=layout.fingerprint())
    hit_blocks = store.longest_prefix(ids)
    buffer = de_buffer(8 * layout.full_block_bytes)
    lease = buffer.allocate(request_id, hit_blocks * layout.full_block_bytes)
    blocks = lease.full_blocks(layout, hit_blocks)
    with ReadQueue(store, 1e9, clock=ManualClock(auto_advance=True)) as queue:
        for ticket in queue.submit_many(ids[:hit_blocks], list(blocks)):
            ticket.wait()
    hit_kv = [layout.field_view(layout.layer_rows(blocks, layer), "kv") for layer in range(layout.num_layers)]
    return hit_blocks, hit_kv, buffer, lease


@settings(max_examples=8, deadline=None)
@given(
    prefix_len=st.integers(BLOCK_TOKENS, 3 * BLOCK_TOKENS + 7),
    append=st.integers(1, 9),
    seed=st.integers(0, 99),
    dtype=st.sampled_from(DTYPES),
)
def test_prefix_cached_layerwise_prefill_equals_full_recompute(tmp_path_factory, prefix_len, append, seed, dtype):
    model = TinyLlama(TinyLlamaConfig(seed=seed % 3), dtype=dtype)
    reference = model.with_dtype(torch.float64)
    store = LocalBlockStore(tmp_path_factory.mktemp("kv"), model.config.kv_layout(dtype, BLOCK_TOKENS))
    first_turn = prompt(prefix_len, seed)
    cache_prefix_in_store(model, store, first_turn)
    second_turn = torch.cat([first_turn, prompt(append, seed + 1)])

    hit_blocks, hit_kv, buffer, lease = load_hit_kv(store, second_turn, "turn2")
    num_hit = hit_blocks * BLOCK_TOKENS
    assert hit_blocks == prefix_len // BLOCK_TOKENS

    # Layer by layer, as the PE does: hit KV of layer l in, miss KV of layer l out.
    hidden = model.embed(second_turn[num_hit:])
    miss_kv = []
    for layer in range(model.config.num_layers):
        hidden, layer_miss = model.layer_forward(layer, hidden, hit_kv[layer])
        miss_kv.append(layer_miss)
    cached_logits = model.logits(hidden)

    full_logits, full_kv = model.forward(second_turn)
    ref_logits, ref_kv = reference.forward(second_turn)
    # The hit KV that went through the store and the buffer is bit-identical to what the model computed.
    for layer in range(model.config.num_layers):
        assert torch.equal(hit_kv[layer].view(torch.uint8), full_kv[layer][:num_hit].view(torch.uint8))
    assert (cached_logits.double() - full_logits[num_hit:].double()).abs().max() <= SAME_DTYPE_ATOL[dtype]
    assert (cached_logits.double() - ref_logits[num_hit:]).abs().max() <= LOGIT_ATOL[dtype]
    assert (full_logits.double() - ref_logits).abs().max() <= LOGIT_ATOL[dtype]
    for layer in range(model.config.num_layers):
        kv_error = (miss_kv[layer].double() - ref_kv[layer][num_hit:]).abs().max()
        assert kv_error <= LOGIT_ATOL[dtype], f"layer {layer} miss KV off by {kv_error}"
    lease.release()  # hit_kv may view the lease: release only after the last use
    assert buffer.stats().used_bytes == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_greedy_decoding_from_the_cached_prefix_matches_full_recompute(tmp_path, dtype):
    model = TinyLlama(dtype=dtype)
    store = LocalBlockStore(tmp_path, model.config.kv_layout(dtype, BLOCK_TOKENS))
    first_turn = prompt(2 * BLOCK_TOKENS + 5, seed=7)
    cache_prefix_in_store(model, store, first_turn)
    second_turn = torch.cat([first_turn, prompt(6, seed=8)])
    hit_blocks, hit_kv, _, lease = load_hit_kv(store, second_turn, "turn2")
    cached = model.generate_greedy(second_turn[hit_blocks * BLOCK_TOKENS :], 12, hit_kv=hit_kv)
    lease.release()
    assert cached == model.generate_greedy(second_turn, 12)  # incremental decode, no prefix cache
    assert cached == model.generate_greedy_recompute(second_turn, 12)  # no cache at all
    if dtype == torch.float32:  # bf16 rounding may flip near-ties against float64; float32 must not here
        assert cached == model.with_dtype(torch.float64).generate_greedy_recompute(second_turn, 12)


def test_weights_come_from_the_seed():
    a, b = TinyLlama(TinyLlamaConfig(seed=1)), TinyLlama(TinyLlamaConfig(seed=1))
    c = TinyLlama(TinyLlamaConfig(seed=2))
    assert all(torch.equal(a.weights[name], b.weights[name]) for name in a.weights)
    assert not torch.equal(a.weights["embed"], c.weights["embed"])
    bf16 = TinyLlama(TinyLlamaConfig(seed=1), dtype=torch.bfloat16)
    assert torch.equal(bf16.with_dtype(torch.float64).weights["lm_head"], bf16.weights["lm_head"].double())


def test_bad_inputs_are_rejected_by_name():
    model = TinyLlama()
    with pytest.raises(BoundsError, match=r"token ids must be in \[0, 512\), got range \[0, 512\]"):
        model.embed([0, 512])
    with pytest.raises(ValueError, match=r"hit_kv must be torch.float32 \[T_hit, 2, 2, 16\]"):
        model.layer_forward(0, model.embed([1]), torch.zeros(3, 2, 4, 16))
    with pytest.raises(BoundsError, match="layer 4 out of range"):
        model.layer_forward(4, model.embed([1]))
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        TinyLlamaConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        TinyLlama(dtype=torch.float16)
