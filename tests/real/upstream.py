"""A real llama.cpp server (SmolLM2-135M-Instruct via llama-cpp-python) on loopback, started by the tests.

``scripts/real-model`` (run by ``make test``) builds the server's venv and extracts the model into the cache dir
once; this module only finds them and runs the server on a free port with a small ``n_ctx``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

LAUNCHER = Path(__file__).with_name("launch_llama.py")
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The same directory ``scripts/real-model`` fills."""
    if explicit := os.environ.get("CTXPROXY_TEST_CACHE"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ctxproxy-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_ready(base: str, process: subprocess.Popen[bytes], log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama.cpp server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"llama.cpp server not ready after {seconds}s:\n{log.read_text()[-3000:]}")


@contextmanager
def llama_server(n_ctx: int, log: Path) -> Iterator[str]:
    """Run the real server; yield its base URL (no ``/v1``); stop it, by PID, after."""
    python, model = cache_dir() / "llama-venv" / "bin" / "python", cache_dir() / MODEL_NAME
    if not python.exists() or not model.exists():
        raise RuntimeError(f"real model upstream missing under {cache_dir()}: run scripts/real-model (make test does)")
    port = free_port()
    command = [str(python), str(LAUNCHER), "--model", str(model), "--n_ctx", str(n_ctx), "--n_threads", "1",
               "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(base, process, log, seconds=120)
        yield base
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a process this code started: terminate, and kill it if it has not exited in 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def agent_history(rounds: int, lines: int) -> list[dict[str, Any]]:
    """A scripted agent run's history: a task, then per round a shell call and a ``lines``-line result
    (about 6.5 tokens a line)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. Be brief."},
                                     {"role": "user", "content": "Find where the config is loaded and fix it."}]
    for i in range(rounds):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "sh", "arguments": json.dumps({"cmd": f"sed -n 1,{lines}p src/mod_{i}.py"})}}
        body = "\n".join(f"def step_{i}_{n}(config, request):  # mod_{i} line {n}" for n in range(lines))
        history += [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": body}]
    return history
