"""Two hosts on one machine: two network namespaces joined by a veth pair (root and iproute2 only).

Each namespace has its own network stack (its loopback, one end of the veth pair with a private /30 address), so
a process started in one reaches the other only through the pair, as across two machines. Used by
``tools/bench_mooncake.py`` and the two-hosts test of the vLLM connector. Traffic stays between the two namespaces
(and each one's loopback): nothing is routed outside.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why :class:`Hosts` cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "making network namespaces needs iproute2 (ip netns)"
    return None


def _run(*command: str) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=COMMAND_TIMEOUT_S)


class Hosts:
    """Two namespaces ``names`` joined by a veth pair (``ifaces``, addresses ``addrs``); a context manager whose
    exit (or :meth:`close`, idempotent) removes them and the pair, whatever failed on the way in."""

    def __init__(self, prefix: str = "adp-mc") -> None:
        tag = os.getpid() % 100000
        self.names = (f"{prefix}-{tag}-s", f"{prefix}-{tag}-r")
        self.ifaces = (f"adpmc{tag}s", f"adpmc{tag}r")  # at most 15 characters
        net = tag % 250
        self.addrs = (f"10.231.{net}.1", f"10.231.{net}.2")
        self.made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self.made.append(name)
            _run("ip", "link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for name, iface in zip(self.names, self.ifaces, strict=True):
                _run("ip", "link", "set", iface, "netns", name)
            for name, iface, addr in zip(self.names, self.ifaces, self.addrs, strict=True):
                _run("ip", "-n", name, "addr", "add", f"{addr}/30", "dev", iface)
                _run("ip", "-n", name, "link", "set", iface, "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT_S)
        self.made.clear()
        for iface in self.ifaces:  # left in this namespace only when moving it failed
            subprocess.run(["ip", "link", "del", iface], stderr=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT_S)

    def command(self, side: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[side], *argv]

    def call(self, side: int, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` on a thread that joined namespace ``side`` (its sockets are that host's); its result, or its
        exception; TimeoutError when it did not return within ``timeout_s``."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                with open(f"/var/run/netns/{self.names[side]}") as ns:
                    if ctypes.CDLL(None, use_errno=True).setns(ns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.names[side]} failed")
                outcome["value"] = fn()
            except BaseException as error:  # re-raised on the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=run, name=f"netns-{side}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"a call inside namespace {self.names[side]} did not return within {timeout_s} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
