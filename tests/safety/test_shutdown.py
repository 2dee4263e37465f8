"""How the commands end when an engine dies or they are interrupted or killed (defects D7 and D8).

Each test runs ``python -m ascend_dualpath ...`` in its own session (so the whole process tree can be found and
signalled like a terminal's Ctrl-C) with its own temporary directory, then checks the exit status, the output,
``/dev/shm`` and that no process of the session is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A demo short to set up and long enough to be interrupted while its engines work (0.2 MB/s storage reads).
DEMO = [
    "demo",
    "--agents",
    "2",
    "--turns",
    "8",
    "--first-prompt",
    "64",
    "--append",
    "16",
    "--gen",
    "1",
    "--snic-mbps",
    "0.2",
    "--no-verify",
]
# Engines start within this (two spawned interpreters importing torch on a loaded machine).
START_S = 90.0
# What the issue allows for anything to outlive the command.
ORPHAN_S = 5.0
EXIT_S = 30.0


class Run:
    """One command in a new session, with stdout and stderr in files and TMPDIR in ``tmp_path``."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        env = dict(os.environ, TMPDIR=str(self.tmp), PYTHONUNBUFFERED="1")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ascend_dualpath", *args],
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def shm(self) -> list[str]:
        """This run's shared memory: the demo's fabrics carry its pid."""
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"adp.demo{self.pid}x"))

    def wait_for_engines(self) -> None:
        """Until both engines opened their devices (regions of two pids on the fabric)."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            owners = {n.split(".")[2] for n in self.shm() if n.count(".") == 3}
            if len(owners) == 2:
                return
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}): {self.text()}"
            time.sleep(0.1)
        pytest.fail(f"the engines did not start within {START_S} s")

    def session(self) -> list[int]:
        """Live (not zombie) processes of the run's session."""
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
            if fields[3] == str(self.pid) and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    def wait(self) -> int:
        return self.proc.wait(EXIT_S)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + ORPHAN_S
        while (self.session() or self.shm() or os.listdir(self.tmp)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.session() == [], f"processes outlived the command by {ORPHAN_S} s"
        assert self.shm() == [], "shared memory left in /dev/shm"
        assert os.listdir(self.tmp) == [], "files left in the temporary directory"

    def kill(self) -> None:
        """Make sure nothing of this run survives a failed test."""
        for pid in self.session():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(*args: str) -> Run:
        runs.append(Run(tmp_path, *args))
        return runs[-1]

    yield start
    for r in runs:
        r.kill()


def _without_progress(stderr: str) -> list[str]:
    """stderr's lines less the progress lines a command prints off a terminal (``simulate: run 1/5 ...``,
    ``demo: [dual] turns served 3/16``, ``bench moe: row 3/8 ...``)."""
    return [line for line in stderr.splitlines() if not re.match(r"[\w ]+: .*\b\d+/\d+\b", line)]


def test_d07_engine_killed_during_demo_reports_the_engine_error(run):
    """The PE killed after the first turn: the demo ends with exit 1 and prints the error it got, unmangled."""
    r = run(*DEMO, "--snic-mbps", "100", "--kill-pe-after", "1", "--timeout", "2")
    assert r.wait() == 1, r.text()
    text = r.text()
    assert "MarkupError" not in text and "Traceback" not in text, text
    assert "demo (dual) failed:" in text, text
    r.assert_nothing_left()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_d08_interrupted_demo_prints_one_line_and_leaves_nothing(run, signum, code):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to the demo process."""
    r = run(*DEMO)
    r.wait_for_engines()
    if signum == signal.SIGINT:
        os.killpg(r.pid, signum)
    else:
        os.kill(r.pid, signum)
    assert r.wait() == code, r.text()
    assert _without_progress(r.err.read_text()) == [f"demo: interrupted by {signal.Signals(signum).name}"], r.text()
    assert "Traceback" not in r.out.read_text()
    r.assert_nothing_left()


def test_d08_demo_killed_by_sigkill_leaves_nothing(run):
    """``kill -9`` of the demo process: its engines remove the fabric and the store and exit."""
    r = run(*DEMO)
    r.wait_for_engines()
    assert os.listdir(r.tmp), "the demo's store should exist while it runs"
    os.kill(r.pid, signal.SIGKILL)
    assert r.wait() == -signal.SIGKILL
    r.assert_nothing_left()


def test_d08_next_demo_start_removes_what_dead_demos_left(tmp_path, monkeypatch):
    """Leftovers of a demo killed together with its engines are removed at the next start; a live one's are not."""
    from ascend_dualpath.cli import demo

    monkeypatch.setattr(demo.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(demo, "SHM_DIR", str(tmp_path / "shm"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getpid()
    (tmp_path / "shm").mkdir()
    for pid in (dead_pid, live_pid):
        (tmp_path / "shm" / f"adp.demo{pid}x0").write_bytes(b"fabric")
        (tmp_path / "shm" / f"adp.demo{pid}x0.{pid + 1}.0").write_bytes(b"region")
        (tmp_path / f"adp-demo-store-{pid}-abc").mkdir()
        (tmp_path / f"adp-demo-store-{pid}-abc" / "block").write_bytes(b"kv")
    removed = demo.reap_dead_runs()
    assert len(removed) == 3 and all(str(dead_pid) in path for path in removed), removed
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(["block", f"adp.demo{live_pid}x0", f"adp.demo{live_pid}x0.{live_pid + 1}.0"]), left


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--agents", "512", "--sweep", "", "--out", "OUT"],
        [
            "bench",
            "moe",
            "--ranks",
            "2",
            "--strategies",
            "alltoall",
            "--tokens",
            "64",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "100000",
            "--deadline-s",
            "120",
        ],
    ],
    ids=["simulate", "bench-moe"],
)
def test_d08_interrupted_commands_print_one_line_and_stop_children(run, tmp_path, command):
    """SIGINT to the process group of ``simulate`` (no children) and ``bench moe`` (two rank processes)."""
    r = run(*[str(tmp_path / "out") if arg == "OUT" else arg for arg in command])
    time.sleep(8 if command[0] == "bench" else 4)  # bench: past the ranks' start, into the measurements
    assert r.proc.poll() is None, f"finished before the signal: {r.text()}"
    os.killpg(r.pid, signal.SIGINT)
    assert r.wait() == 130, r.text()
    lines = _without_progress(r.err.read_text())
    assert len(lines) == 1 and lines[0].startswith(f"{command[0]}: interrupted by SIGINT"), r.text()
    r.assert_nothing_left()
