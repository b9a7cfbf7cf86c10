"""The long synthetic agent run the tests and benches replay: seeded, deterministic, built here, nothing to download.

Why: the suite and ``bench/`` must run from a bare clone. This module is the project's one generator of the long
workload (issue #10, item 9): a system prompt and a task, then ``rounds`` rounds of a short assistant text with one
tool call, each answered by a 2–20 KB tool result of a realistic shape (a Python module, a pytest log with a
failure, grep hits, an issue tracker's JSON, a server log, a ``git log -p``). Round 3's result (``call_002``) opens
with ``NEEDLE`` so a cut can be checked for restoring byte for byte. Sixty rounds come to 122 messages and
640 KB of text (a 680 KB body), the size of the peers' shared workload (``--conversation`` in the benches takes
that file instead).

The output shapes are also the bodies of the agent transcripts of ``tests/transcripts.py``. The recorded
third-party trajectories stay an external corpus: ``trajectories_dir()`` reads its one setting.

Run: ``python -m tests.workloads --rounds 60 --seed 7 --out conversation-60.json``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NEEDLE = "SECRET_TOKEN=needle-4471"
"""Opens round 3's result: what a restore check looks for."""
TRAJECTORIES_ENV = "CTXPROXY_TRAJECTORIES"
"""The one setting for the recorded trajectories (a directory of ``*.native.json`` / ``*.fenced.json``)."""

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {key: {"type": "string"} for key in keys}, "required": list(keys[:1])}}}
    for name, text, keys in (
        ("read_file", "Read a file of the repository and return its text.", ("path",)),
        ("run_shell", "Run a shell command in the repository; return its exit status and output.", ("command",)),
        ("grep", "Search the repository for a regular expression; return the matching lines.", ("pattern", "path")),
        ("http_get", "GET a URL of the issue tracker's API and return its JSON body.", ("url",)),
        ("write_file", "Replace a file of the repository with new content.", ("path", "content")),
    )
]
SYSTEM = ("You are an autonomous software engineer working in a Python service's repository. You can read files, "
          "run shell commands, search the code, query the issue tracker and write files. Call one tool at a time, "
          "read before you change, run the tests after every change, and do not guess what a file contains. "
          "Finish with a short account of what you changed and why.\n") * 4
TASK = ("Since the last release the nightly test run fails and customers report invoices dated the 30th of "
        "February. Find the cause, fix it with a test that would have caught it, and list related tracker issues.")
NOUNS = ("invoice", "ledger", "account", "tenant", "payment", "refund", "currency", "period", "report", "batch",
         "worker", "queue", "retry", "schedule", "cursor", "page", "window", "quota", "token", "session", "cache",
         "record", "field", "index", "stream", "result", "status", "limit")
VERBS = ("load", "parse", "render", "apply", "merge", "split", "check", "build", "emit", "resolve", "fetch", "store",
         "flush")

Shape = Callable[[random.Random, int], str]


def _name(r: random.Random) -> str:
    return "_".join([r.choice(VERBS), *r.sample(NOUNS, r.randint(1, 2))])


def _fill(size: int, lines: Iterator[str]) -> str:
    """Lines until ``size`` characters, cut at ``size``: the shapes differ only in the lines they make."""
    out, length = [], 0
    for line in lines:
        out.append(line)
        length += len(line) + 1
        if length >= size:
            break
    return "\n".join(out)[:size]


def python_module(r: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        yield from (f'"""{r.choice(NOUNS).capitalize()} handling for the billing service."""', "",
                    "from __future__ import annotations", "", "import datetime as dt", "import logging", "")
        while True:
            args = ", ".join(r.sample(NOUNS, r.randint(1, 3)))
            yield f"def {_name(r)}({args}):"
            yield f'    """{r.choice(VERBS).capitalize()} the {r.choice(NOUNS)} of a {r.choice(NOUNS)}."""'
            for _ in range(r.randint(2, 7)):
                yield f"    {r.choice(NOUNS)} = {_name(r)}({r.choice(NOUNS)}, limit={r.randint(1, 500)})"
            yield f"    if not {r.choice(NOUNS)}:"
            yield f"        raise ValueError(f\"no {r.choice(NOUNS)} for {{{r.choice(NOUNS)}!r}}\")"
            yield f"    return {r.choice(NOUNS)}"
            yield ""
    return _fill(size, lines())


def pytest_log(r: random.Random, size: int) -> str:
    tail = ["", "=" * 35 + " FAILURES " + "=" * 35, "_" * 30 + " test_invoice_period_end " + "_" * 30,
            "    def test_invoice_period_end():",
            ">       assert period_end(dt.date(2024, 1, 31)) == dt.date(2024, 2, 29)",
            "E       ValueError: day is out of range for month", "billing/periods.py:57: ValueError",
            "=" * 20 + " short test summary info " + "=" * 20, "FAILED tests/test_periods.py::test_invoice_period_end"]

    def lines() -> Iterator[str]:
        yield from ("=" * 30 + " test session starts " + "=" * 30, "platform linux -- Python 3.12.4, pytest-8.3.3",
                    "rootdir: /srv/billing", "configfile: pyproject.toml", "collected 518 items", "")
        for n in range(1, 10**6):
            verdict = "FAILED" if r.random() < 0.02 else "PASSED"
            yield f"tests/test_{r.choice(NOUNS)}.py::test_{_name(r)} {verdict} [{min(99, n // 5):3d}%]"
    budget = max(0, size - sum(len(line) + 1 for line in tail))
    return (_fill(budget, lines()) + "\n" + "\n".join(tail))[:size]


def grep_hits(r: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        while True:
            yield (f"billing/{r.choice(NOUNS)}/{_name(r)}.py:{r.randint(1, 800)}:        "
                   f"{r.choice(NOUNS)} = period_end({r.choice(NOUNS)}.{r.choice(NOUNS)}, months={r.randint(1, 12)})")
    return _fill(size, lines())


def tracker_json(r: random.Random, size: int) -> str:
    """A JSON array of issues, whole (valid JSON), as close under ``size`` as items allow."""
    items: list[dict[str, Any]] = []
    length = 2
    while True:
        item = {"number": 2000 + len(items), "title": f"{_name(r)} breaks on {r.choice(NOUNS)} boundaries",
                "state": r.choice(("open", "closed", "closed")), "labels": r.sample(("bug", "billing", "dates",
                                                                                  "regression", "ux", "perf"), 2),
                "opened": f"2024-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:00:00Z",
                "comments": r.randint(0, 40), "reporter": {"login": _name(r), "id": r.randint(1, 10**5)},
                "body": " ".join(r.choice(NOUNS + VERBS) for _ in range(r.randint(10, 40)))}
        encoded = len(json.dumps(item, indent=1)) + 2
        if items and length + encoded > size:
            return json.dumps(items, indent=1)
        items.append(item)
        length += encoded


def server_log(r: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        while True:
            level = r.choices(("INFO", "DEBUG", "WARNING", "ERROR"), (70, 20, 7, 3))[0]
            yield (f"2024-11-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:"
                   f"{r.randint(0, 59):02d}.{r.randint(0, 999):03d}Z {level:<7} billing.{r.choice(NOUNS)} "
                   f"req={r.getrandbits(40):010x} {_name(r)} {r.randint(1, 2000)}ms "
                   f"status={r.choice((200, 200, 200, 201, 404, 422, 500))}")
    return _fill(size, lines())


def git_log(r: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        while True:
            path = f"billing/{r.choice(NOUNS)}.py"
            yield from (f"commit {r.getrandbits(160):040x}", f"Author: {_name(r)} <dev@example.test>",
                        f"    {r.choice(VERBS).capitalize()} {r.choice(NOUNS)} before the {r.choice(NOUNS)}", "",
                        f"diff --git a/{path} b/{path}", f"--- a/{path}", f"+++ b/{path}",
                        f"@@ -{r.randint(1, 300)},6 +{r.randint(1, 300)},7 @@ def {_name(r)}(")
            for _ in range(r.randint(3, 9)):
                yield f"{r.choice(' +-')}    {r.choice(NOUNS)} = {_name(r)}({r.choice(NOUNS)})"
    return _fill(size, lines())


ROUNDS: tuple[tuple[str, Callable[[random.Random], dict[str, str]], Shape], ...] = (
    ("read_file", lambda r: {"path": f"billing/{r.choice(NOUNS)}.py"}, python_module),
    ("run_shell", lambda r: {"command": "python -m pytest -q tests/"}, pytest_log),
    ("grep", lambda r: {"pattern": r"period_end\(", "path": "billing/"}, grep_hits),
    ("http_get", lambda r: {"url": f"https://tracker.example.test/api/issues?label=dates&page={r.randint(1, 9)}"},
     tracker_json),
    ("run_shell", lambda r: {"command": "tail -n 500 /var/log/billing/app.log"}, server_log),
    ("run_shell", lambda r: {"command": f"git log -p -n {r.randint(2, 6)} -- billing/"}, git_log),
)
"""Round k uses entry k modulo 6: tool, its arguments, the shape of its result."""


def output(r: random.Random, round_: int, size: int) -> tuple[str, dict[str, str], str]:
    """Round ``round_``'s tool name, arguments and result of about ``size`` characters."""
    name, arguments, shape = ROUNDS[round_ % len(ROUNDS)]
    return name, arguments(r), shape(r, size)


@functools.lru_cache(maxsize=8)
def _encoded(rounds: int, seed: int) -> bytes:
    r = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for k in range(rounds):
        name, arguments, result = output(r, k, r.randint(2_000, 19_000))
        call_id = f"call_{k:03d}"
        messages.append({"role": "assistant", "content": f"Round {k + 1}: {name} next, to narrow it down.",
                         "tool_calls": [{"id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        if k == 2:
            result = f"{NEEDLE}  # left in config/.env.sample\n{result}"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return json.dumps({"model": "fake-model", "tools": TOOLS, "messages": messages}).encode()


def conversation(rounds: int = 60, seed: int = 7) -> dict[str, Any]:
    """The workload as a chat body ``{"model", "tools", "messages"}``; a fresh object each call (built once)."""
    built: dict[str, Any] = json.loads(_encoded(rounds, seed))
    return built


def trajectories_dir() -> Path | None:
    """The recorded trajectories' directory from ``CTXPROXY_TRAJECTORIES``, or None when it is not set."""
    value = os.environ.get(TRAJECTORIES_ENV, "").strip()
    return Path(value).expanduser().absolute() if value else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("conversation.json"))
    args = parser.parse_args(argv)
    args.out.write_bytes(_encoded(args.rounds, args.seed))
    built = conversation(args.rounds, args.seed)
    chars = sum(len(m.get("content") or "") for m in built["messages"])
    print(f"wrote {args.out}: {len(built['messages'])} messages, {chars:,} content characters")


if __name__ == "__main__":
    main()
