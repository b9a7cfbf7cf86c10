"""The ``ctxproxy`` command: ``serve`` runs the proxy; ``sessions`` and ``show`` read the journal directly;
``replay`` sends a recorded conversation through the proxy's own request path, with the recording as its
upstream (``proxy.commands.replay``).

The reading commands open the journal file themselves (SQLite in WAL mode lets them read while a server writes),
so they work whether or not a server is running.

Importing this module costs only the standard library and the settings: each command imports what it uses when it
runs (the journal and sqlite-utils, the server stack, the tokenizer), so ``ctxproxy --help`` is instant and
``ctxproxy serve`` reaches ready sooner (issue #13; ``tests/test_packaging.py`` holds the line).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxproxy.config import Settings, SettingsError, load_settings
from ctxproxy.config.settings import unknown_environment
from ctxproxy.proxy import __version__
from ctxproxy.proxy.commands.tables import render_table

if TYPE_CHECKING:
    from ctxproxy.store import Journal

__all__ = ["main"]

_SESSION_COLUMNS = [("id", "session"), ("parent_id", "parent"), ("requests", "requests"), ("messages", "messages"),
                    ("last_prompt_tokens", "last prompt tok"), ("model", "model"), ("updated_at", "updated")]


_SCORE_COLUMNS = [("session_id", "session"), ("rounds", "rounds"), ("tool_calls", "tool calls"),
                  ("input_tokens", "input tok"), ("total_tokens", "total tok"), ("tokens_per_round", "tok/round"),
                  ("tokens_per_tool_call", "tok/call"), ("ops", "context ops")]
_REPLAY_COLUMNS = [("request", "req"), ("messages", "msgs"), ("tokens_in", "tokens in"), ("tokens_out", "tokens out"),
                   ("decisions", "decisions"), ("prefix", "prefix"), ("chars_reused", "reused chars"),
                   ("tokens_notices", "notices"), ("chars_sent", "sent chars"), ("refused", "")]


_DESCRIPTION = ("ctxproxy: an OpenAI-compatible proxy that manages a long-running agent's context. `serve` runs "
                "it; the other commands read its journal or check its setup. Every setting is also CTXPROXY_<KEY> "
                "in the environment or a key of a TOML file (--config): see config/default.toml.")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for warning in unknown_environment(os.environ):
        print(f"ctxproxy: warning: {warning}", file=sys.stderr)
    try:
        settings = load_settings(args.config, os.environ, _flags(args))
    except SettingsError as exc:
        print(f"ctxproxy: {exc}", file=sys.stderr)
        return 2
    from ctxproxy.store import JournalUnavailable
    from ctxproxy.store.failures import storage_errors

    try:
        with storage_errors(settings.journal_location):
            code = int(args.run(settings, args))
        sys.stdout.flush()  # here, where a closed pipe can still be caught, not at the interpreter's exit
        return code
    except JournalUnavailable as exc:  # a full, read-only or corrupt journal: its path and the fix, no traceback
        print(f"ctxproxy: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ctxproxy sessions | head`: the reader has what it wanted
        return _quiet_pipe()


def _quiet_pipe() -> int:
    """The reader of our output went away: point stdout at /dev/null so the interpreter's final flush does not
    raise again (Python's documented recipe, "Note on SIGPIPE" in the signal module's docs), and end quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxproxy", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ctxproxy {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    serve = _command(commands, "serve", "run the proxy", _serve)
    serve.add_argument("--upstream", help="OpenAI-compatible base URL (default http://127.0.0.1:8080/v1)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 4141)")
    _command(commands, "sessions", "list the journal's sessions", _sessions)
    _command(commands, "scorecard", "tokens per session, per round and per tool call; the model's context ops",
             _scorecard)
    doctor = _command(commands, "doctor", "check the upstream, its window, the offline tokenizer, the data dir",
                      _doctor)
    doctor.add_argument("--upstream", help="OpenAI-compatible base URL to check")
    doctor.add_argument("--model", help="the model whose window to look up")
    prune = _command(commands, "prune", "remove sessions idle for longer than DURATION, and the bodies only they "
                     "referred to", _prune)
    prune.add_argument("--older-than", dest="older_than", required=True, type=_duration, metavar="DURATION",
                       help="idle time: a number and s, m, h, d or w (30d, 12h)")
    prune.add_argument("--dry-run", dest="dry_run", action="store_true", help="print what would go, change nothing")
    prune.add_argument("--vacuum", action="store_true",
                       help="then shrink the file (rewrites it: needs as much free space again)")
    show = _command(commands, "show", "show one session and its journal", _show)
    show.add_argument("session_id")
    show.add_argument("--limit", type=int, default=200, help="journal entries to print (default 200)")
    replay = _command(commands, "replay", "send a recorded conversation through the proxy's request path, offline "
                      "(the recording answers as the model)", _replay)
    replay.add_argument("file", help="a conversation: {messages, tools?} (the shared trajectory format)")
    replay.add_argument("--window", type=int, help="the model's window in tokens (default: ctx_window, else 131072)")
    replay.add_argument("--protocol", choices=("chat", "responses"), default="chat",
                        help="what the agent speaks: chat completions, or the Responses API (through /v1/responses)")
    return parser


def _command(commands: Any, name: str, help: str, run: Any) -> argparse.ArgumentParser:
    cmd: argparse.ArgumentParser = commands.add_parser(name, help=help, description=help)
    cmd.add_argument("--config", help="TOML settings file (env CTXPROXY_CONFIG)")
    cmd.add_argument("--data-dir", dest="data_dir", help="journal directory (env CTXPROXY_DATA_DIR)")
    cmd.add_argument("--store", help="the journal's PostgreSQL URL (env CTXPROXY_STORE; default: SQLite in the "
                                     "data dir)")
    if name != "serve":
        cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(run=run)
    return cmd


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k, None) for k in ("upstream", "host", "port", "data_dir", "store")}


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from ctxproxy.proxy.edge.app import create_app
    from ctxproxy.proxy.edge.serving import port_taken, uvicorn_options
    from ctxproxy.proxy.engine.state import one_malloc_arena
    from ctxproxy.proxy.observe.logs import configure_logging
    from ctxproxy.store import open_journal

    one_malloc_arena()  # before the server's threads start (issue #13: 2.2 MB idle)
    open_journal(settings.journal_location, settings.journal_sync, check=True).close()  # refused here: no traceback
    taken = port_taken(settings.host, settings.port)
    if taken:
        print(f"ctxproxy: {taken}", file=sys.stderr)
        return 1
    configure_logging(settings)
    app = create_app(settings, journal_checked=True)  # checked just above: not read whole a second time
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, **uvicorn_options(settings))
    return 0


def _replay(settings: Settings, args: argparse.Namespace) -> int:
    from ctxproxy.proxy.commands.replay import ReplayFailed, conversation_problem, replay, summarize

    try:
        conversation = json.loads(Path(args.file).read_text())
    except (OSError, ValueError) as exc:
        print(f"ctxproxy replay: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    problem = conversation_problem(conversation)
    if problem:
        print(f"ctxproxy replay: {args.file} is not a conversation: {problem}", file=sys.stderr)
        return 2
    window = args.window or settings.ctx_window or 131072
    try:
        steps = list(replay(conversation, settings, window, protocol=args.protocol))
    except ReplayFailed as exc:
        print(f"ctxproxy replay: {exc}", file=sys.stderr)
        return 1
    summary = summarize(steps)
    if args.json:
        print(json.dumps({"window": window, "steps": [asdict(s) for s in steps],
                          "summary": asdict(summary) | {"reuse": summary.reuse, "uncached": summary.uncached}},
                         indent=2))
        return 0
    rows = [asdict(s) | {"decisions": ", ".join(f"{k} {v}" for k, v in s.decisions.items()) or "-",
                         "prefix": "kept" if s.prefix_kept else "changed",
                         "refused": "REFUSED" if s.refused else "OVER WINDOW" if s.over_window else ""} for s in steps]
    print(render_table(rows, _REPLAY_COLUMNS))
    print(f"\n{summary.requests} requests, window {window}: {summary.refused} refused (cannot fit), "
          f"{summary.violations} invariant violations, max {summary.max_tokens_out} tokens sent, prefix reuse "
          f"{summary.reuse:.1%} ({summary.uncached:,} uncached characters of {summary.chars_sent:,}), "
          f"{summary.newest_lost} characters of the newest rounds' text folded, {summary.unrestorable} cuts "
          f"not restorable, {summary.over_window} over the window")
    return 0


def _with_journal(command: Callable[[Journal, Settings, argparse.Namespace], int]
                  ) -> Callable[[Settings, argparse.Namespace], int]:
    """A reading command: given the journal, closed after it (a PostgreSQL connection is not left to the exit)."""
    @functools.wraps(command)
    def run(settings: Settings, args: argparse.Namespace) -> int:
        journal = _open_journal(settings)
        if journal is None:
            return 1
        try:
            return command(journal, settings, args)
        finally:
            journal.close()

    return run


def _open_journal(settings: Settings) -> Journal | None:
    from ctxproxy.store import open_journal

    location = settings.journal_location
    if isinstance(location, Path) and not location.exists():
        print(f"No journal at {location} yet: start `ctxproxy serve` and send it a request.", file=sys.stderr)
        return None
    return open_journal(location, settings.journal_sync)


@_with_journal
def _sessions(journal: Journal, settings: Settings, args: argparse.Namespace) -> int:
    rows = journal.sessions()
    print(json.dumps({"sessions": rows}, indent=2) if args.json  # the shape of GET /ctx/sessions
          else render_table(rows, _SESSION_COLUMNS))
    return 0


def _doctor(settings: Settings, args: argparse.Namespace) -> int:
    from ctxproxy.proxy.commands.doctor import run_checks

    checks = run_checks(settings, args.model)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for check in checks:
            print(f"{check.label}  {check.name}: {check.detail}")
    return 0 if all(c.ok for c in checks) else 1


@_with_journal
def _scorecard(journal: Journal, settings: Settings, args: argparse.Namespace) -> int:
    from ctxproxy.proxy.observe.metrics import aggregate

    rows = journal.scorecard()
    if args.json:
        print(json.dumps({"rows": rows, "aggregate": aggregate(rows)}, indent=2))
        return 0
    table = [r | {"ops": ", ".join(f"{k} {v}" for k, v in (r.get("context_ops") or {}).items() if v) or "-"}
             for r in rows]
    print(render_table(table, _SCORE_COLUMNS))
    means = aggregate(rows)
    print("\nmeans: " + ", ".join(f"{k.removeprefix('avg_')} {v}" for k, v in means.items() if v is not None))
    return 0


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(text: str) -> timedelta:
    number, unit = text[:-1], text[-1:]
    if not number.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write a number and s, m, h, d or w (30d)")
    return timedelta(seconds=int(number) * _UNITS[unit])


@_with_journal
def _prune(journal: Journal, settings: Settings, args: argparse.Namespace) -> int:
    cutoff = (datetime.now(UTC) - args.older_than).isoformat(timespec="milliseconds")
    report = journal.prune(cutoff, dry_run=args.dry_run)
    if args.vacuum and not args.dry_run:
        journal.vacuum()
    if args.json:
        print(json.dumps(asdict(report) | {"cutoff": cutoff}, indent=2))
        return 0
    verb = "Would remove" if report.dry_run else "Removed"
    print("\n".join(report.sessions) + ("\n" if report.sessions else ""), end="")
    print(f"{verb} {len(report.sessions)} sessions idle since before {cutoff}: {report.requests} requests, "
          f"{report.blobs} bodies ({report.blob_chars:,} characters). Kept {report.kept_for_children} idle sessions "
          "that a newer session descends from.")
    return 0


@_with_journal
def _show(journal: Journal, settings: Settings, args: argparse.Namespace) -> int:
    session = journal.session(args.session_id)
    if session is None:
        print(f"No session {args.session_id!r}; `ctxproxy sessions` lists them.", file=sys.stderr)
        return 1
    from ctxproxy.proxy.commands.showing import rounds, session_text

    numbered = rounds(journal.session_journal(args.session_id, 0, args.limit), journal.cuts_by_request(args.session_id))
    print(json.dumps({"session": session, "journal": numbered}, indent=2) if args.json
          else session_text(session, numbered))
    return 0
