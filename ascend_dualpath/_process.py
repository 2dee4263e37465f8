"""Child processes that end with their parent: deaf to Ctrl-C, and gone (after cleaning up) when the parent dies.

Ctrl-C sends SIGINT to every process of the terminal's foreground group. Only the parent should react (stop its
children, print one line): children started inside :func:`sigint_blocked` inherit a signal mask with SIGINT
blocked (``fork`` and ``exec`` keep the mask), so the signal stays pending in them and no child prints a
``KeyboardInterrupt`` traceback. The parent stops them with SIGTERM.

A parent killed by SIGKILL runs no cleanup at all, so a child calls :func:`watch_parent` first thing: a daemon
thread checks every :data:`PARENT_POLL_S` whether the process has been re-parented (the parent died), then runs
the child's ``cleanup`` (removing what the dead parent owned: shared memory, a temporary directory) and exits.
``PR_SET_PDEATHSIG`` is not used: it would kill the child before it could clean up. The thread needs the GIL,
which the runtime's waits release.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

# How often a child checks that its parent is alive: the bound on how long a child outlives its parent.
PARENT_POLL_S = 0.2
# Exit status of a child that ended because its parent died.
EXIT_ORPHANED = 3


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


def watch_parent(
    parent_pid: int, cleanup: Callable[[], None] | None = None, poll_s: float = PARENT_POLL_S
) -> threading.Thread:
    """End this process within ``poll_s`` seconds of the death of ``parent_pid``, running ``cleanup`` first.

    Call it in a child, as early as possible. Returns the (daemon) watching thread.
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
