"""The package's import graph, built from the sources with ``ast``: no cycle among module-level imports, and no
package importing one above it in the layer order of docs/architecture.md (section "Layers, bottom up")."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ascend_dualpath"

# Bottom up, as docs/architecture.md lists them; a package may import its own layer and the ones below. The
# top-level modules (errors, _env, _checks, _ext, _process, _triton_launch, version) are layer 0.
LAYERS = (
    "backends",
    "reference",
    "transport",
    "ops",
    "kv",
    "models",
    "dualpath",
    "moe",
    "sim",
    "integrations",
    "bench",
    "cli",
)
# The package's own entry points sit above every layer (they name the main entry points, run the CLI).
FRONT_DOOR = ("ascend_dualpath", "ascend_dualpath.__main__")
# Known upward imports, each with the work that removes it. Empty this as that work lands.
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _targets(module: str, path: pathlib.Path, node: ast.stmt, modules: dict) -> set[str]:
    """The package modules an import statement loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if node.level:
        package = package[: len(package) - node.level + 1]
        source = ".".join(package + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
    names = {alias.name for alias in node.names if f"{source}.{alias.name}" not in modules}
    # `from pkg import submodule` loads pkg too, but pkg is already loading whenever a module inside it runs
    found = set(submodules)
    if names and source in modules:
        found.add(source)
    return found


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[name] |= _targets(name, path, node, modules) - {name}
            elif module_level_only and isinstance(node, ast.If | ast.Try):
                # conditional module-level imports (``if TYPE_CHECKING`` aside) still run at import time
                if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                    for inner in ast.walk(node):
                        if isinstance(inner, ast.Import | ast.ImportFrom):
                            graph[name] |= _targets(name, path, inner, modules) - {name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _layer(module: str) -> int:
    if module in FRONT_DOOR:
        return len(LAYERS) + 1
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return 0
    return LAYERS.index(parts[1]) + 1


def test_no_import_cycle():
    cycle = _find_cycle(import_graph(module_level_only=True))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_package_imports_a_layer_above_it():
    """Function-level imports count too: a lazy import is still a dependency."""
    upward = sorted(
        (module, target)
        for module, targets in import_graph(module_level_only=False).items()
        for target in targets
        if _layer(target) > _layer(module)
    )
    unexpected = [pair for pair in upward if pair not in UPWARD_ALLOWED]
    assert not unexpected, "imports of a higher layer: " + ", ".join(f"{a} -> {b}" for a, b in unexpected)
    stale = UPWARD_ALLOWED - set(upward)
    assert not stale, f"UPWARD_ALLOWED lists imports that are gone (remove them): {sorted(stale)}"


def test_every_subpackage_has_a_layer():
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(LAYERS), f"add {sorted(subpackages - set(LAYERS))} to LAYERS and docs/architecture.md"
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name in LAYERS:
        assert f"{name}/" in architecture or f"{name} " in architecture, f"docs/architecture.md names no {name}/"
