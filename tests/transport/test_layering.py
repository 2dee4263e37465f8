"""Layering: no module of ``ascend_dualpath.transport`` imports the benchmarks or anything above transport."""

from __future__ import annotations

import ast
import pathlib

import ascend_dualpath

PACKAGE = pathlib.Path(ascend_dualpath.__file__).parent
ABOVE_TRANSPORT = ("bench", "dualpath", "cli", "integrations", "sim", "kv", "moe", "models")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved against the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level])
                names.add(f"{base}.{node.module}" if node.module else base)
            else:
                names.add(node.module)
    return names


def test_no_transport_module_imports_a_layer_above_it():
    offenders = []
    for path in sorted((PACKAGE / "transport").glob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "ascend_dualpath" and len(parts) > 1 and parts[1] in ABOVE_TRANSPORT:
                offenders.append(f"{path.name} imports {name}")
    assert not offenders, offenders


def test_the_scan_sees_an_import_of_bench(tmp_path):
    """The scan is not vacuous: a module importing bench is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ascend_dualpath.bench.transfer import Row\nimport ascend_dualpath.bench\n")
    assert {"ascend_dualpath.bench.transfer", "ascend_dualpath.bench"} <= _imports(probe)
