"""Docs of the present: every figure file is cited and every cited one exists; nothing points outside the repo."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a path outside the repository could hide: code, build files, docs, tests, CI.
SCANNED = ("ascend_dualpath", "csrc", "op_kernels", "tools", "tests", "docs", "examples", ".ci")
SCANNED_FILES = ("README.md", "setup.py", "pyproject.toml")
SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".hpp", ".cc", ".txt", ".toml", ".cfg", ".cmake", ".rst", ""}
FIGURE_REF = re.compile(r"figures/([A-Za-z0-9_.{},-]+)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)")


def _cited() -> set[str]:
    names = set()
    for doc in DOCS:
        for ref in FIGURE_REF.findall(doc.read_text()):
            ref = ref.rstrip(".,")
            if "{" in ref:  # `cuda_engine_{1gpu,2gpu}.json`
                head, rest = ref.split("{", 1)
                options, tail = rest.split("}", 1)
                names |= {head + option + tail for option in options.split(",")}
            else:
                names.add(ref)
    return names


def test_every_figure_is_cited_and_every_citation_exists():
    present = {path.name for path in FIGURES.iterdir()}
    cited = _cited()
    assert not present - cited, f"docs/figures holds files no doc cites (delete them): {sorted(present - cited)}"
    assert not cited - present, f"docs cite figures that do not exist: {sorted(cited - present)}"


def test_markdown_links_resolve_inside_the_repo():
    for doc in DOCS:
        for target in MD_LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:") or not re.fullmatch(r"[\w./-]*\w[\w./-]*", target):
                continue  # a URL, or code such as `kernel[grid](...)`
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc.relative_to(ROOT)} links outside the repo: {target}"
            assert resolved.exists(), f"{doc.relative_to(ROOT)} links to a missing file: {target}"


def _scanned_files():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path
    for name in SCANNED_FILES:
        yield ROOT / name


def test_nothing_points_outside_the_repository():
    """No ``../`` that climbs out of the repo (from the file's folder), and no sibling ``shared/`` folder."""
    this = pathlib.Path(__file__).resolve()
    escapes = []
    for path in _scanned_files():
        if path.resolve() == this:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"(^|[\s\"'`(=])\.\./shared\b|(^|[\s\"'`(])/work/|(^|[\s\"'`(])\.\./\.\./\.\.", line):
                escapes.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
                continue
            for match in re.finditer(r"(?:\.\./)+[A-Za-z0-9_.-]+", line):
                resolved = (path.parent / match.group(0)).resolve()
                if not resolved.is_relative_to(ROOT):
                    escapes.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not escapes, "paths outside the repository:\n" + "\n".join(escapes)


def test_no_relative_include_climbs_between_kernel_folders():
    """Headers shared by kernels live in op_kernels/include/adp/, not beside one kernel."""
    climbing = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for folder in ("op_kernels", "csrc")
        for path in (ROOT / folder).rglob("*.[ch]*")
        for line in path.read_text(errors="replace").splitlines()
        if line.startswith("#include") and "../" in line
    ]
    assert not climbing, climbing
