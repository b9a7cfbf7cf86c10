"""The shared GPU cost model, run on a trace of upstream requests: what a workload costs on one H200.

Why: issue #13 asks for the GPU seconds of each workload beside the proxy's own cost, from the cost model the
peers were measured with (``gpu_seconds.py`` and its H200 table, in the peers' ``bench/gpu/`` folder: not part of
this repository). ``bench/long_run.py`` (the 600-round runs, from the journal) and ``bench/rewrite.py`` (the
60- and 600-round workloads at the upstream) hand it their traces; without the folder (``--gpu-model DIR`` or
``CTXPROXY_GPU_MODEL``) the seconds are left out, and the report says so.

A trace is one object per upstream request, in order: ``chars`` (the request's characters) and ``reused_chars``
(those that repeat the previous request's from its start, what a prefix cache keeps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["GPU_ENV", "default_model", "gpu_seconds", "missing_note"]

GPU_ENV = "CTXPROXY_GPU_MODEL"


def default_model() -> Path | None:
    """The folder ``CTXPROXY_GPU_MODEL`` names, if set (``--gpu-model``'s default)."""
    return Path(os.environ[GPU_ENV]) if os.environ.get(GPU_ENV) else None


def missing_note(model_dir: Path | None) -> str:
    """What a report says when it has no cost model to run ("" when it has one)."""
    return "" if model_dir else (f"GPU seconds left out: no cost model given (--gpu-model DIR or {GPU_ENV}, "
                                 "the folder holding the shared gpu_seconds.py).")


def gpu_seconds(model_dir: Path | None, rows: list[dict[str, int]], tmp: Path) -> dict[str, Any] | None:
    """The shared cost model's verdict on the trace (its JSON line), or None without the model."""
    if model_dir is None:
        return None
    path = tmp / f"trace-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(rows))
    done = subprocess.run([sys.executable, str(model_dir / "gpu_seconds.py"), str(path)], capture_output=True,
                          text=True, check=True)
    return dict(json.loads(done.stdout))
