"""The suite needs nothing beside the repository (issue #10, item 9): a bare clone's ``make test`` passes.

The workload and the agent transcripts are generated (``tests/workloads.py``, ``tests/transcripts.py``); the one
external input, the recorded trajectories, comes from ``CTXPROXY_TRAJECTORIES`` and is one skip without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"parents\[2\]|\bROOT\.parent\b|[\"']/work/|[\"']\.\./shared|/ [\"']shared[\"']")
"""How the tests and benches used to reach ``../shared`` or a fixed path of one machine."""
FORMERLY_OUTSIDE = ["tests/test_corpus.py", "tests/test_fenced.py", "tests/test_trajectories.py",
                    "tests/test_tokens.py::test_the_benchmark_conversation_is_counted_once_and_close_to_tiktoken",
                    "tests/test_rewriting.py::test_what_was_cut_is_restorable_byte_for_byte"]


def test_no_test_or_bench_reads_a_path_outside_the_repository() -> None:
    sources = [p for d in ("tests", "bench") for p in sorted((ROOT / d).rglob("*.py")) if p != Path(__file__)]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sources
             for n, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []


def tracked_copy(into: Path) -> Path:
    """The repository's tracked files (their current text) in ``into``/repo, with nothing beside it: a clone. Out
    of a git checkout (an unpacked archive), everything but the venv and the caches."""
    clone = into / "repo"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", ".*_cache",
                                                                    ".hypothesis"))
        return clone
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    return clone


def test_in_a_clone_with_nothing_beside_it_the_tests_that_read_shared_pass_and_the_corpus_is_one_skip(
        tmp_path: Path) -> None:
    clone = tracked_copy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")} | {"PYTHONPATH": str(clone)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *FORMERLY_OUTSIDE],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    skips = [re.sub(r":\d+:", ":N:", line) for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips == ["SKIPPED [1] tests/test_corpus.py:N: CTXPROXY_TRAJECTORIES is not set: "
                     "the recorded trajectories are not replayed"], done.stdout[-3000:]
