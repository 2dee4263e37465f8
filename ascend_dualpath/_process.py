"""Supervision of the processes a command starts: one set of rules for ``demo``, ``bench`` and ``serve``.

**Signals.** Every command of ``python -m ascend_dualpath`` runs inside :func:`handle_signals`. On the first
SIGINT or SIGTERM the main thread raises :class:`Interrupted` wherever it is. It derives from BaseException, so
``except Exception`` does not swallow it, while ``finally`` blocks and context managers on the way out run as
usual (that is where a command stops its children and removes what it created; :func:`signals_deferred` keeps a
later signal from cutting such a clean-up short); further signals are ignored meanwhile. Then the registered
and ``multiprocessing`` children still alive are stopped (:func:`stop`), one line is printed (the command, the
signal and what the command added to :attr:`Interrupted.details`) and the process exits with ``128 + signal``.

**Children.** Started inside :func:`sigint_blocked`, a child inherits a signal mask with SIGINT blocked (``fork``
and ``exec`` keep the mask): Ctrl-C, which the terminal sends to the whole foreground group, reaches only the
parent, and no child prints a ``KeyboardInterrupt`` traceback; the parent stops them with SIGTERM. A parent killed
by SIGKILL runs no clean-up at all, so children must end on their own:

- the library's own Python children call :func:`watch_parent` first thing: a daemon thread notices the
  re-parenting within :data:`PARENT_POLL_S`, runs the child's clean-up (the dead parent's shared memory, its
  temporary directory) and exits;
- programs that are not the library's (``vllm serve``) start in a session of their own with
  :func:`die_with_parent` (``PR_SET_PDEATHSIG``: SIGKILL when the parent dies), and :func:`start_group_watcher`
  SIGKILLs their whole process groups then: their own children (vLLM's engine core) do not follow on their own.

**Leftovers.** What a run creates outside itself (shared memory, a temporary directory) carries its pid in its
name; :func:`reap_dead_owners` removes what a dead process left (one killed together with its children).

**Stopping.** :func:`stop` sends SIGTERM to every process (to its whole group when it leads one), waits a
bounded grace for processes and groups to empty, SIGKILLs what is left and reaps them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How often a child checks that its parent is alive: the bound on how long a child outlives its parent.
PARENT_POLL_S = 0.2
# Exit status of a child that ended because its parent died.
EXIT_ORPHANED = 3
# How long a child may take to exit after SIGTERM before it is killed.
STOP_GRACE_S = 3.0
PR_SET_PDEATHSIG = 1

# (process, leads its own process group) of the running command, stopped on SIGINT / SIGTERM.
_registered: list[tuple[Any, bool]] = []


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM inside :func:`handle_signals`; ``signum`` says which.

    ``details``: what the command's clean-up wants said on the one line printed at the end.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.details: list[str] = []


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while the block runs; processes started inside keep it blocked for life.

    A SIGINT that arrives meanwhile is delivered to this process when the block ends, not lost.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while the block (a clean-up) runs; one that arrived is delivered after it."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def watch_parent(
    parent_pid: int, cleanup: Callable[[], None] | None = None, poll_s: float = PARENT_POLL_S
) -> threading.Thread:
    """End this process within ``poll_s`` seconds of the death of ``parent_pid``, running ``cleanup`` first.

    Call it in a child, as early as possible. Returns the (daemon) watching thread. The thread needs the GIL,
    which the runtime's waits release.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        try:
            if cleanup is not None:
                cleanup()
        except BaseException as exc:  # say so, but exit regardless: nothing else ends this process now
            print(
                f"process {os.getpid()}: cleanup after the death of its parent {parent_pid} failed: {exc!r}",
                file=sys.stderr,
                flush=True,
            )
        os._exit(EXIT_ORPHANED)  # the main thread may sit in a wait on a peer that is gone too

    thread = threading.Thread(target=watch, name=f"watch-parent-{parent_pid}", daemon=True)
    thread.start()
    return thread


def _set_parent_death_signal(signum: int) -> None:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def die_with_parent() -> None:
    """``preexec_fn`` of a program that is not the library's: SIGKILL it when this process dies."""
    _set_parent_death_signal(signal.SIGKILL)


def term_with_parent() -> None:
    """``preexec_fn`` of a process that cleans up on SIGTERM: SIGTERM it when this process dies."""
    _set_parent_death_signal(signal.SIGTERM)


# The group watcher: argv = parent pid, then the process groups to SIGKILL once the parent is gone. The ppid
# check covers a parent that died between the fork and the prctl.
GROUP_WATCHER = """
import os, signal, sys
parent, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2:]]
def kill_groups(*_):
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)
signal.signal(signal.SIGTERM, kill_groups)
if os.getppid() != parent:
    kill_groups()
while True:
    signal.pause()
"""


def start_group_watcher(groups: list[int]) -> subprocess.Popen:
    """Start the process that SIGKILLs ``groups`` if this process dies (:func:`stop` it, as a group leader,
    once they are stopped)."""
    argv = [sys.executable, "-c", GROUP_WATCHER, str(os.getpid()), *map(str, groups)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=term_with_parent)  # fmt: skip


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_owners(directory: str, prefix: str, sep: str, before: Callable[[str], Any] | None = None) -> list[str]:
    """Remove the entries of ``directory`` named ``<prefix><pid>`` or ``<prefix><pid><sep>...`` whose process
    ``pid`` is dead (files and directory trees); returns their paths. Entries of live processes, and names whose
    part after ``prefix`` is not a pid, stay. ``before(path)`` runs first for each entry removed (what the entry
    names outside it goes too)."""
    import shutil

    removed = []
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for name in names:
        pid = name[len(prefix) :].split(sep)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        if before is not None:
            before(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        removed.append(path)
    return removed


def _alive(process: Any) -> bool:
    return process.is_alive() if hasattr(process, "is_alive") else process.poll() is None


def _group_exists(pgid: int) -> bool:
    """Whether any process (zombies included, until reaped) is still in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process took the id: it exists
    return True


def _running(process: Any, group: bool) -> bool:
    """Alive, or (for a group leader) its group still holds processes: an exited leader is reaped by
    ``poll``, the processes it started may live on."""
    return _alive(process) or (group and _group_exists(process.pid))


def _signal(process: Any, group: bool, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(process.pid, signum)
        elif _alive(process):
            os.kill(process.pid, signum)


def _reap(process: Any, timeout_s: float) -> None:
    if hasattr(process, "join"):
        process.join(timeout_s)
    else:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)


def stop(processes: list[tuple[Any, bool]], grace_s: float = STOP_GRACE_S, exit_wait_s: float = 0.0) -> int:
    """Stop ``(process, leads its own group)`` pairs (``subprocess.Popen`` or ``multiprocessing.Process``).

    Waits up to ``exit_wait_s`` for them to end on their own (a finished job), then SIGTERMs each (its whole
    group when it leads one), gives them ``grace_s`` in all to end (groups to empty), SIGKILLs what is left
    and reaps every process. Returns how many were still running when SIGTERM went out.
    """
    deadline = time.monotonic() + exit_wait_s
    while any(_alive(p) for p, _ in processes) and time.monotonic() < deadline:
        time.sleep(0.02)
    running = [(p, group) for p, group in processes if _running(p, group)]
    for process, group in running:
        _signal(process, group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_running(p, group) for p, group in running) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process, group in running:
        _signal(process, group, signal.SIGKILL)
    for process, _ in processes:
        _reap(process, grace_s)  # bounded: SIGKILL cannot be ignored
    return len(running)


def register_child(process: Any, group: bool = False) -> None:
    """Have ``process`` (``subprocess.Popen`` or ``multiprocessing.Process``; ``group``: it leads its own
    process group, which is stopped whole) stopped on SIGINT or SIGTERM. ``multiprocessing`` children are
    found without registration."""
    _registered.append((process, group))


def _raise_interrupted(signum: int, frame: Any) -> None:
    for other in SIGNALS:
        signal.signal(other, signal.SIG_IGN)  # the way out runs once, without a second traceback
    raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals(command: str) -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM turned into :class:`Interrupted`, then into one line on stderr and
    ``SystemExit(128 + signal)`` (130 for SIGINT, 143 for SIGTERM) after stopping the children.

    Outside the main thread (where Python cannot install handlers) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import multiprocessing

    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in SIGNALS}
    try:
        yield
    except Interrupted as interrupted:
        children = [*_registered, *((p, False) for p in multiprocessing.active_children())]
        stopped = stop(children)
        details = [*interrupted.details]
        if stopped:
            details.append(f"stopped {stopped} child process{'es' if stopped != 1 else ''}")
        line = "; ".join([f"{command}: interrupted by {signal.Signals(interrupted.signum).name}", *details])
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(128 + interrupted.signum) from None
    finally:
        _registered.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
