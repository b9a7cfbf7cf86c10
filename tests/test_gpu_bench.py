"""The workloads' GPU seconds (issue #13): ``bench/rewrite.py``'s upstream trace and the shared cost model run on it
(``bench/gpu_model.py``, as ``bench/long_run.py`` runs it), here with a stand-in for the model's script."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.benches import bench_module

rewrite = bench_module("rewrite")
gpu_model = bench_module("gpu_model")

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "You are an agent. Ünïcode counts in bytes."}
TASK = {"role": "user", "content": "Fix the bug."}


def _chars(message: dict[str, Any]) -> int:
    return len(json.dumps(message, ensure_ascii=False).encode())


def test_the_trace_counts_each_request_and_what_repeats_the_one_before_from_its_start() -> None:
    result = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    edited = {"role": "system", "content": "Another opening."}
    tools = len(json.dumps(TOOLS, ensure_ascii=False))
    trace = rewrite.upstream_trace([
        {"messages": [SYSTEM, TASK], "tools": TOOLS},
        {"messages": [], "tools": TOOLS},  # a body with no messages (a probe) is not a request of the run
        {"messages": [SYSTEM, TASK, result], "tools": TOOLS},
        {"messages": [edited, TASK, result], "tools": TOOLS},
    ])
    assert trace == [
        {"chars": _chars(SYSTEM) + _chars(TASK) + tools, "reused_chars": 0},
        {"chars": _chars(SYSTEM) + _chars(TASK) + _chars(result) + tools,
         "reused_chars": _chars(SYSTEM) + _chars(TASK) + tools},
        {"chars": _chars(edited) + _chars(TASK) + _chars(result) + tools, "reused_chars": tools},
    ]


def _stand_in(folder: Path) -> Path:
    """A ``gpu_seconds.py`` that reads a trace as the shared one does and answers with what it read."""
    (folder / "gpu_seconds.py").write_text(
        "import json, sys\n"
        "rows = json.load(open(sys.argv[1]))\n"
        "print(json.dumps({'tokens_processed': sum(r['chars'] - r['reused_chars'] for r in rows) // 4,"
        " 'total_s': float(len(rows))}))\n")
    return folder


def test_each_workload_sent_through_the_app_gets_the_models_verdict_on_its_trace(tmp_path: Path) -> None:
    model = _stand_in(tmp_path)
    report: dict[str, Any] = {
        "conversation_60_at_32k": {"reuse": 0.9, "trace": [{"chars": 400, "reused_chars": 0},
                                                           {"chars": 800, "reused_chars": 400}]},
        "rewrite_cost_600_vs_60": {"ms": 1.0},
        "unknown_wrapper_generated": [{"reuse": 0.7}],
        "gpu_note": gpu_model.missing_note(model),
    }
    rewrite.with_gpu_seconds(report, model)
    assert report["conversation_60_at_32k"] == {"reuse": 0.9, "gpu": {"tokens_processed": 200, "total_s": 2.0}}
    assert report["rewrite_cost_600_vs_60"] == {"ms": 1.0} and report["gpu_note"] == ""


def test_without_the_model_the_seconds_are_left_out_and_the_report_says_so() -> None:
    report: dict[str, Any] = {"conversation_60_at_32k": {"trace": [{"chars": 4, "reused_chars": 0}]}}
    rewrite.with_gpu_seconds(report, None)
    assert report["conversation_60_at_32k"] == {"gpu": None}
    assert "no cost model given" in gpu_model.missing_note(None) and gpu_model.GPU_ENV in gpu_model.missing_note(None)


def test_the_model_folder_defaults_to_the_environments(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv(gpu_model.GPU_ENV, str(tmp_path))
    assert gpu_model.default_model() == tmp_path
    monkeypatch.delenv(gpu_model.GPU_ENV)
    assert gpu_model.default_model() is None
