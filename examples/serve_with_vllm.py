"""Serving with vLLM: a tiny model behind ``serve`` (one prefill and one decode vLLM instance plus the DualPath
proxy), asked one completion through the ``openai`` client.

Needs vLLM (``bash tools/install_vllm.sh``, which brings ``openai``); without vLLM or ``openai`` it prints
``skipped: ...`` and exits 0. Everything lives in a temporary directory (the model, serve's logs, the TMPDIR of
serve and vLLM), removed at the end; start-up takes 30-90 s on a small CPU machine.

Run::

    python3 examples/serve_with_vllm.py

Prints serve's ready line and the answer; exits 1 if serve does not come up within its bound, the answer is
empty, or serve does not stop cleanly on SIGINT.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

STARTUP_S = 420.0  # bound of serve's start-up (two vLLM instances on a loaded 2-core machine)
STOP_S = 60.0  # bound of serve's clean stop after SIGINT
ANSWER_TOKENS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_line(lines: queue.Queue, prefix: str, timeout_s: float) -> str:
    """The first line of serve's output that starts with ``prefix``; raises TimeoutError naming it after
    ``timeout_s``, RuntimeError if serve ended first (both with serve's last lines)."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        if line is None:
            raise RuntimeError(f"serve exited before printing {prefix!r}:\n{''.join(seen[-15:])}")
        if line.startswith(prefix):
            return line.rstrip()
        seen.append(line)
    raise TimeoutError(f"no {prefix!r} line from serve within {timeout_s:.0f} s:\n{''.join(seen[-15:])}")


def ask(port: int, model: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120.0, max_retries=0)
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=ANSWER_TOKENS,
                                      temperature=0)  # fmt: skip
    return reply.choices[0].text


def run(tmp: str) -> int:
    run_tmp = os.path.join(tmp, "r")  # torch and vLLM leave compile caches and IPC sockets in TMPDIR: keep them in ours
    os.mkdir(run_tmp)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **os.environ, "TMPDIR": run_tmp}  # small KV cache
    model = os.path.join(tmp, "model")
    make = [sys.executable, "-m", "ascend_dualpath", "make-tiny-model", model]
    subprocess.run(make, env=env, check=True, timeout=300)
    port = free_port()
    argv = [sys.executable, "-m", "ascend_dualpath", "serve", "--model", model, "--port", str(port),
            "--log-dir", os.path.join(tmp, "logs"), "--startup-timeout", str(STARTUP_S)]  # fmt: skip
    serve = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # serve's output, line by line, so that every wait on it is bounded
        for line in serve.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        print(wait_for_line(lines, "serve: ready", STARTUP_S + 30))
        answer = ask(port, model)
        print(f"completion of 'The capital of France is' ({ANSWER_TOKENS} tokens, greedy): {answer!r}")
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)  # serve stops its vLLM instances and the proxy, then exits 130
        try:
            code = serve.wait(STOP_S)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
            code = None
    if code != 128 + signal.SIGINT:
        print(f"FAILED: serve exited with {code} after SIGINT (expected {128 + signal.SIGINT})", file=sys.stderr)
        return 1
    if not answer:
        print("FAILED: empty answer", file=sys.stderr)
        return 1
    print("serve stopped cleanly on SIGINT")
    return 0


def main() -> int:
    missing = [name for name in ("vllm", "openai") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"skipped: {' and '.join(missing)} not installed (bash tools/install_vllm.sh)")
        return 0
    # a short name: vLLM's IPC socket paths under it must stay within the 107 bytes of a Unix socket address
    with tempfile.TemporaryDirectory(prefix="adp-ex-") as tmp:
        try:
            return run(tmp)
        except (RuntimeError, TimeoutError, subprocess.SubprocessError) as error:
            print(f"FAILED: {error}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
