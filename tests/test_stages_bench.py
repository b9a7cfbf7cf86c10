"""``bench/stages.py``: where a small new-text request's time goes in a real server, stage by stage (issue #13)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.benches import bench_module

ROOT = Path(__file__).resolve().parent.parent


def _stages() -> ModuleType:
    return bench_module("stages")


def test_each_stage_is_told_by_its_median_start_and_span_and_a_repeat_by_its_number() -> None:
    stages = _stages()
    requests = [{"placed": (10.0, 30.0), "committed": (40.0, 50.0), "committed #2": (90.0, 95.0)},
                {"placed": (12.0, 40.0), "committed": (44.0, 60.0), "committed #2": (99.0, 109.0)},
                {"placed": (14.0, 38.0), "committed": (48.0, 52.0)}]
    rows = stages.medians(requests)
    assert [row["stage"] for row in rows] == ["placed", "committed", "committed #2"]  # by when they start
    assert rows[0] == {"stage": "placed", "requests": 3, "starts_us": 12.0, "takes_us": 24.0}
    assert rows[2]["requests"] == 2 and rows[2]["takes_us"] == 7.5

    timeline = stages.Timeline()
    timeline.span("placed", 0)  # before any request: not told
    timeline.arrived()
    for _ in range(3):
        timeline.span("committed", timeline._start)
    assert list(timeline.requests[0]) == ["committed", "committed #2", "committed #3"]


def test_a_short_run_times_every_stage_of_each_small_request_in_a_real_server() -> None:
    """Three new-text requests after the generated 60-round replay, through the instrumented ``ctxproxy serve``
    app under uvicorn: every stage ``STAGES`` names is met once a request (the journal's commit twice), in the
    order of the request's way, and within the time to the answer's last byte. A stage renamed in the code
    fails here rather than in a benchmark run."""
    stages = _stages()
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "stages.py"), "--requests", "3"],
                         capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in run.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")]
    told = {stage: (int(n), float(starts), float(takes)) for stage, n, starts, takes in rows}
    expected = [label for _, _, label in stages.STAGES] + ["journal: committed #2", stages.SENT]
    assert set(expected) <= set(told), run.stdout
    assert all(told[label][0] == 3 for label in expected), run.stdout
    order = [label for label in told if label in expected and label != stages.SENT]
    assert order.index("journal: placed") < order.index("journal: committed") \
        < order.index("forward planned") < order.index("upstream: headers back") \
        < order.index("journal: answer written"), run.stdout
    assert all(starts + takes <= told[stages.SENT][2] + 1 for label, (_, starts, takes) in told.items()
               if label in expected), run.stdout
