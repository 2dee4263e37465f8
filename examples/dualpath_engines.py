"""DualPath's two read paths, with the prefill (PE) and decode (DE) engines in one process.

The engines of ``python3 -m ascend_dualpath demo`` (a tiny Llama, a block store on disk, KV moved over the
emulated RoCE fabric), started in one process by ``in_process_engines``. A first turn fills the store; the next
prompt extends it, so its prefix is a storage hit. That same prompt is then loaded twice: once through the PE
read path (the PE's storage NIC reads the hit blocks, the PE streams each complete layer to the DE) and once
through the DE read path (the DE's storage NIC reads them and pushes each hit layer to the PE, which returns
only the new tokens' rows; hit and miss rows merge in the DE's HBM).

Run::

    python3 examples/dualpath_engines.py

Prints which storage NIC read what on each path; exits 1 unless, on both paths, the hit rows in the DE's HBM
equal the stored blocks bit for bit, every KV row is within bf16 tolerance of a float64 recompute, and the two
paths leave identical KV.
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np
import torch

from ascend_dualpath.dualpath.bootstrap import in_process_engines
from ascend_dualpath.dualpath.nodes import KV_BF16_ATOL, EngineConfig, verify_turn

GEN = 2  # tokens generated per turn


def main() -> int:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="adp-example-store-") as store:
        config = EngineConfig(
            store,
            block_tokens=16,
            max_tokens=256,
            pe_snic_bytes_per_s=1e9,  # uncapped storage NICs: the example is about bytes, not time
            de_snic_bytes_per_s=1e9,
            pe_buffer_bytes=1 << 20,
            de_buffer_bytes=2 << 20,
            timeout_s=20.0,
        )
        first = [int(t) for t in rng.integers(0, config.model.vocab_size, 64)]
        with in_process_engines(config) as (_, de):
            (cold,), _, _ = de.serve_wave([(0, 0, first, GEN)], "pe")  # nothing cached yet: fills the store
            prompt = cold.sequence + [int(t) for t in rng.integers(0, config.model.vocab_size, 10)]
            (via_pe,), _, _ = de.serve_wave([(0, 1, prompt, GEN)], "pe")
            (via_de,), _, _ = de.serve_wave([(1, 0, prompt, GEN)], "de")
            reference = de.model.with_dtype(torch.float64)
            checks = {
                result.path: verify_turn(result, prompt, de.model, reference, de.store, de.namespace, KV_BF16_ATOL)
                for result in (via_pe, via_de)
            }
    failures = []
    print(f"prompt of {len(prompt)} tokens; the first turn stored its KV ({cold.prompt_tokens} tokens prefilled)")
    for result in (via_pe, via_de):
        check = checks[result.path]
        print(
            f"{result.path.upper()} read path: {result.hit_tokens} hit tokens, {result.pe_read_bytes} bytes read "
            f"through the PE's storage NIC, {result.de_read_bytes} through the DE's; "
            f"hit rows bit-exact: {check['loaded_exact']}, worst KV error {check['kv_max_err']:.4f}"
        )
        if result.error is not None or result.hit_tokens == 0:
            failures.append(f"{result.path}: error {result.error}, {result.hit_tokens} hit tokens")
        if not check["loaded_exact"] or check["kv_max_err"] > KV_BF16_ATOL or not check["tokens_equal"]:
            failures.append(f"{result.path}: {check}")
    if (via_pe.path, via_de.path) != ("pe", "de") or via_pe.de_read_bytes or via_de.pe_read_bytes:
        failures.append(f"paths {via_pe.path}/{via_de.path} did not read where they were sent")
    if not torch.equal(via_pe.kv, via_de.kv):
        failures.append("the PE and DE paths left different KV in the DE's HBM")
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(f"merged KV identical on both paths: {tuple(via_pe.kv.shape)} uint8 rows [layers, tokens, bytes]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
