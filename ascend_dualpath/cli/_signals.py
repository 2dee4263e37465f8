"""SIGINT and SIGTERM in a command: children stopped, one line on stderr, exit status 130 or 143.

Every command of ``python -m ascend_dualpath`` runs inside :func:`handle_signals` (see :func:`cli.main`). A
command that starts processes of its own either uses :mod:`multiprocessing` (its children are found without
registration) or passes other handles (``subprocess.Popen``) to :func:`register_child`. Children should be
started inside :func:`ascend_dualpath._process.sigint_blocked` (so Ctrl-C, which the terminal sends to the whole
process group, reaches only this process) and call :func:`ascend_dualpath._process.watch_parent` (so they end
even when this process is killed by SIGKILL)::

    with handle_signals("serve"):
        with sigint_blocked():
            server = subprocess.Popen([...])
        register_child(server)
        ...

On the first SIGINT or SIGTERM the main thread raises :class:`Interrupted` wherever it is. It derives from
BaseException, so ``except Exception`` does not swallow it, while ``finally`` blocks and context managers on the
way out run as usual (that is where a command removes what it created); further signals are ignored meanwhile.
Then the children still alive get SIGTERM, and SIGKILL after :data:`STOP_GRACE_S`; one line is printed and the
process exits with ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a child may take to exit after SIGTERM before it is killed.
STOP_GRACE_S = 3.0

_registered: list[Any] = []


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM inside :func:`handle_signals`; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def register_child(process: Any) -> None:
    """Have ``process`` (a ``subprocess.Popen`` or ``multiprocessing.Process``) stopped on SIGINT or SIGTERM."""
    _registered.append(process)


def _alive(process: Any) -> bool:
    return process.is_alive() if hasattr(process, "is_alive") else process.poll() is None


def stop_children(grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM to every live registered or multiprocessing child, SIGKILL to those alive ``grace_s`` later.

    Returns how many were alive.
    """
    import multiprocessing

    children = [p for p in [*_registered, *multiprocessing.active_children()] if _alive(p)]
    for process in children:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    for process in children:
        if _alive(process):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    for process in children:  # reap them (bounded: SIGKILL cannot be ignored)
        if hasattr(process, "join"):
            process.join(grace_s)
        else:
            with contextlib.suppress(Exception):
                process.wait(grace_s)
    return len(children)


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
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in SIGNALS}
    try:
        yield
    except Interrupted as interrupted:
        stopped = stop_children()
        children = f"; stopped {stopped} child process{'es' if stopped != 1 else ''}" if stopped else ""
        print(f"{command}: interrupted by {signal.Signals(interrupted.signum).name}{children}", file=sys.stderr)
        raise SystemExit(128 + interrupted.signum) from None
    finally:
        _registered.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
