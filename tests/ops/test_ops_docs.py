"""Every op is under ``torch.ops.ascend_dualpath`` with its schema and a docstring, and docs/ops.md lists each one
with its exact schema."""

from __future__ import annotations

from pathlib import Path

import torch

from ascend_dualpath import ops

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def test_every_op_is_registered_with_a_docstring():
    for op in ops.OPS:
        packet = getattr(torch.ops.ascend_dualpath, op.name)
        assert str(packet.default._schema) == f"ascend_dualpath::{op.schema}"
        for documented in (packet, packet.default):
            assert documented.__doc__.startswith(f"ascend_dualpath::{op.schema}\n\n")
            assert len(documented.__doc__) > len(op.schema) + 60


def test_docs_list_every_op_with_its_schema():
    text = DOC.read_text()
    missing = [op.name for op in ops.OPS if f"ascend_dualpath::{op.schema}\n" not in text]
    assert not missing, f"docs/ops.md lacks the schemas of {missing}"
    listed = {line.split("`")[1] for line in text.splitlines() if line.startswith("### `")}
    assert listed == {op.name for op in ops.OPS}


def test_registry_has_no_op_beyond_ops():
    """Nothing else registers under the namespace (one registration point)."""
    registered = {
        name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("ascend_dualpath::")
    }
    assert registered == {op.name for op in ops.OPS}
