"""Every repository path the docs name exists, and docs/benchmarks.md stays short.

Scanned: README.md, examples/README.md and docs/*.md. Inside them, the text of code (inline backtick spans, and
fenced blocks without their ``#`` comments, which say what a command prints or writes) and the targets of Markdown
links, split into tokens at whitespace; a token loses surrounding
quotes, brackets and trailing punctuation, a ``::test`` or ``:line`` suffix, and ``{a,b}`` expands into each
alternative. Tokens with ``://`` or starting with ``/``, ``$``, ``~`` or ``-`` (URLs, absolute or environment paths,
options) are not paths of the repository. The rules, in order:

1. **rooted**: a token starting with a top-level folder of the repository and ``/`` (``ascend_dualpath/``,
   ``csrc/``, ``op_kernels/``, ``tools/``, ``tests/``, ``docs/``, ``examples/``, ``.ci/``), or one of the
   top-level files (``README.md``, ``setup.py``, ``pyproject.toml``), must exist relative to the repository root;
   ``<placeholder>`` and ``*`` match any one path component, and at least one path must match.
2. **relative**: any other token with a ``/`` ending in a source or doc suffix (``.py .sh .cpp .h .md .toml``)
   must exist relative to the package (``integrations/vllm/proxy.py`` is ``ascend_dualpath/integrations/...``),
   to the doc's own folder (``cluster/small_1p1d.toml`` in examples/README.md), or to the repository root.
3. **bare**: a token without ``/`` ending in ``.py .sh .cpp .h .md`` (``connector.py`` in a table of a package's
   modules) must be the name of some file of the repository.

Data files named without a folder (``cluster.json``, ``table2.jsonl``: what a command writes or an operator
brings) and build outputs (``build/...``, compiled ``.so`` / ``.o`` files such as ``ascend_dualpath/_C*.so``) are
not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ascend_dualpath"
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROOTED_DIRS = ("ascend_dualpath", "csrc", "op_kernels", "tools", "tests", "docs", "examples", ".ci")
ROOTED_FILES = ("README.md", "setup.py", "pyproject.toml")
RELATIVE_SUFFIXES = (".py", ".sh", ".cpp", ".h", ".md", ".toml")
BARE_SUFFIXES = (".py", ".sh", ".cpp", ".h", ".md")
BUILD_SUFFIXES = (".so", ".o")
BENCHMARKS_MAX_LINES = 300

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)")
BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")
SKIP_START = ("/", "$", "~", "-")


def _code_and_links(text: str) -> list[str]:
    spans = [re.sub(r"(^|\s)#.*", "", block, flags=re.M) for block in FENCE.findall(text)]  # not their comments
    spans += INLINE.findall(FENCE.sub("", text))
    spans += LINK.findall(text)
    return spans


def _expand(token: str) -> list[str]:
    match = BRACES.search(token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [out for option in match.group(1).split(",") for out in _expand(head + option + tail)]


def _tokens(span: str) -> list[str]:
    out = []
    for raw in span.split():
        token = raw.strip("\"'()[],;`").split("::")[0]
        token = re.sub(r":\d+$", "", token).rstrip(".:")
        if not token or "://" in token or token.startswith(SKIP_START) or "=" in token:
            continue
        out.extend(_expand(token))
    return out


def _matches(base: Path, token: str) -> bool:
    pattern = re.sub(r"<[^<>/]*>", "*", token).rstrip("/")
    if "*" in pattern:
        return any(base.glob(pattern))
    return (base / pattern).exists()


def _repo_file_names() -> set[str]:
    names = set()
    for path in ROOT.rglob("*"):
        if ".git" not in path.parts and "__pycache__" not in path.parts:
            names.add(path.name)
    return names


def _missing(doc: Path, token: str, names: set[str]) -> bool:
    """True when ``token`` is a repository path by the rules above and does not exist."""
    if token.endswith(BUILD_SUFFIXES):
        return False
    if token.startswith(tuple(d + "/" for d in ROOTED_DIRS)) or token in ROOTED_FILES:
        return not _matches(ROOT, token)
    if "/" in token:
        if not token.endswith(RELATIVE_SUFFIXES) or token.startswith("."):
            return False
        return not any(_matches(base, token) for base in (PACKAGE, doc.parent, ROOT))
    if token.endswith(BARE_SUFFIXES) and not re.search(r"[<>*]", token):
        return token not in names
    return False


def missing_paths() -> list[str]:
    names = _repo_file_names()
    missing = []
    for doc in DOCS:
        for span in _code_and_links(doc.read_text()):
            for token in _tokens(span):
                if _missing(doc, token, names):
                    missing.append(f"{doc.relative_to(ROOT)}: {token}")
    return sorted(set(missing))


def test_every_repository_path_named_in_the_docs_exists():
    missing = missing_paths()
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_rules_catch_a_missing_path(tmp_path):
    """The checker is not vacuous: each rule flags a name that does not exist and passes one that does."""
    names = _repo_file_names()
    doc = ROOT / "docs" / "architecture.md"
    assert _missing(doc, "ascend_dualpath/transport/staging.py", names)
    assert not _missing(doc, "ascend_dualpath/transport/emulator.py", names)
    assert _missing(doc, "op_kernels/<op>/op_kernel/nothing.cpp", names)
    assert not _missing(doc, "op_kernels/<op>/op_kernel/", names)
    assert _missing(doc, "integrations/vllm/gone.py", names)
    assert not _missing(doc, "integrations/vllm/proxy.py", names)
    assert _missing(doc, "bench_cuda_engine.py", names)
    assert not _missing(doc, "connector.py", names)
    assert not _missing(doc, "ascend_dualpath/_C*.so", names)  # a build output
    assert _tokens("`x` ascend_dualpath/sim/{plan,online}.py, tests/a.py::test_b") == [
        "x",
        "ascend_dualpath/sim/plan.py",
        "ascend_dualpath/sim/online.py",
        "tests/a.py",
    ]


def test_benchmarks_page_stays_short():
    """One current table per benchmark, with its command, hardware and date; earlier runs live in git history."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, f"docs/benchmarks.md has {lines} lines > {BENCHMARKS_MAX_LINES}"
