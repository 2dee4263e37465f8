"""Every script in ``examples/`` runs as a user would run it (a subprocess from the repository root), exits 0 and
prints the line that says what it showed; none leaves anything in its temporary directory or in ``/dev/shm``.

Each example checks its own claim and exits 1 when it does not hold, so a broken library fails here. The vLLM
example is slow (two vLLM instances start) and says ``skipped: ...`` where vLLM or ``openai`` is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ascend_dualpath._process import pid_alive

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHM = Path("/dev/shm")
FAST = {
    "transfer_engine.py": "bit-exact: all 2623488 bytes arrived",
    "dualpath_engines.py": "merged KV identical on both paths",
    "moe_two_ranks.py": "combine(dispatch(x)) matches the float64 reference on all 2 ranks",
    "plan_a_cluster.py": "the second read path pays where storage binds",
}
SLOW = {"serve_with_vllm.py": "serve stopped cleanly on SIGINT"}
TIMEOUT_S = {"serve_with_vllm.py": 900}


def _left_in_shm(before: set[str], pid: int) -> list[str]:
    """The library's shared-memory objects (``adp*``) that appeared during the run and that no live process owns:
    their names carry their creator's pid (``adp.fab<pid>x<n>``, ``adp.<fabric>.<pid>.<n>``). Objects of other
    live processes on the machine (other test runs) are not the example's."""
    left = []
    for name in sorted({p.name for p in SHM.iterdir()} - before if SHM.is_dir() else ()):
        pids = [int(n) for n in re.findall(r"\d{2,}", name)]
        if name.startswith("adp") and (pid in pids or not any(pid_alive(p) for p in pids)):
            left.append(name)
    return left


def _run(name: str) -> str:
    # the example's TMPDIR, where whatever it leaves shows; a short path, as a user's is (vLLM puts Unix sockets,
    # whose paths are limited to 107 bytes, in it)
    tmp = Path(tempfile.mkdtemp(prefix="adpx-"))
    try:
        return _run_in(name, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_in(name: str, tmp: Path) -> str:
    before = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S.get(name, 300))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"{name} did not finish within {TIMEOUT_S.get(name, 300)} s:\n{(stdout + stderr)[-4000:]}")
    output = stdout + stderr
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{output[-4000:]}"
    assert not list(tmp.iterdir()), f"{name} left in its temporary directory: {sorted(p.name for p in tmp.iterdir())}"
    assert not _left_in_shm(before, proc.pid), f"{name} left in /dev/shm: {_left_in_shm(before, proc.pid)}"
    return stdout


@pytest.mark.parametrize("name", sorted(FAST))
def test_example_runs_and_shows_what_it_says(name):
    out = _run(name)
    assert FAST[name] in out, out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_example_runs_and_shows_what_it_says(name):
    out = _run(name)
    if out.startswith("skipped:"):
        pytest.skip(out.strip())
    assert SLOW[name] in out and "serve: ready at" in out, out


def test_every_example_is_tested_and_documented():
    """A new example gets a test here and a line in examples/README.md; each says how to run it."""
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(FAST) | set(SLOW), f"untested or missing examples: {scripts ^ (set(FAST) | set(SLOW))}"
    readme = (EXAMPLES / "README.md").read_text()
    for name in sorted(scripts):
        assert f"`{name}`" in readme, f"examples/README.md does not mention {name}"
        assert f"python3 examples/{name}" in (EXAMPLES / name).read_text(), f"{name}: its docstring lacks the command"
