"""``ctxproxy replay``: a recorded conversation sent through the proxy's own request path, request by request,
offline, and what the proxy sent upstream measured.

A conversation (the shared trajectory format: ``{"messages", "tools"?, "model"?}``) is turned into the requests
its agent sent: one each time the agent asked the model, i.e. the history before each assistant message, and the
whole history when it does not end with one. Each goes to the real app (``create_app``), in process, on a
temporary data dir, with the window fixed; its upstream is ``proxy.commands.recording.RecordedUpstream``, which answers
with the recording's next assistant message and keeps every body it gets. So what is measured is what the server
would send, byte for byte (``tests/test_replay.py`` holds it to a running ``ctxproxy serve``): the offer and the
tool list, notices, ``read_overflow`` listed once something is cut, ``null_content``, calibration from the
answers' ``usage``, the journal's decisions. The report of each request:

- tokens in (the agent's request) and out (what went upstream, as the upstream counted it), and whether that is
  over the window;
- the decisions the proxy journaled for it, and whether it refused it (``context_length_exceeded``: it cannot fit
  even after every cut);
- prefix reuse, as the project's benchmarks define it: the characters of a request's leading messages (and its
  tools) byte-identical to the previous upstream request's, over all characters sent;
- problems: the proxy's own invariant check failing (it logs it and forwards the request unchanged), or a
  call/result pair broken in what went upstream;
- the newest round's own text (its assistant message and the user messages after it) folded or hidden to make
  room (``newest_lost``, characters), and cuts whose removed bytes the journal cannot give back under their
  sha256 (``unrestorable``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from ctxproxy.config import Settings
from ctxproxy.proxy.commands.recording import LAST_ANSWER, RecordedUpstream
from ctxproxy.proxy.core import broken_pairs, message_hash, message_ids
from ctxproxy.proxy.core.decisions import CUTS
from ctxproxy.proxy.core.state import sha256_text
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.edge.fronts.responses.spoken import as_spoken, responses_body
from ctxproxy.store import Journal, open_journal

__all__ = ["ReplayFailed", "ReplayStep", "Summary", "agent_requests", "conversation_problem", "replay",
           "replay_settings", "request_body", "summarize"]

REFUSED = "context_length_exceeded"
NOTICE = "[ctxproxy] "
"""How every system line the proxy adds begins (``proxy.tools.blocks``, ``offer``, ``mirror``, ``planning``)."""
_RESTORABLE = CUTS | {"fold"}


class ReplayFailed(Exception):
    """The proxy answered a replayed request with an error other than a refusal to fit it: a bug to report."""


@dataclass(frozen=True)
class ReplayStep:
    request: int
    messages: int
    tokens_in: int
    tokens_out: int
    """What went upstream, as the upstream counted it (0 when refused)."""
    chars_sent: int
    chars_reused: int
    prefix_kept: bool
    """The previous upstream request's messages are a byte-identical prefix of this one's, its tools the same."""
    refused: bool
    """Over budget even after every cut: the proxy answers context_length_exceeded instead of forwarding."""
    decisions: dict[str, int] = field(default_factory=dict)
    violations: tuple[str, ...] = ()
    newest_lost: int = 0
    """Characters of the newest round's assistant and user text folded or hidden in this request."""
    unrestorable: int = 0
    """Cuts of this request whose removed bytes are not in the journal's overflow store under their id."""
    over_window: bool = False
    """What went upstream counts more tokens than the window."""
    tokens_notices: int = 0
    """Of ``tokens_out``, the proxy's own system lines after the projection (notices, the mirror paragraph, the
    fenced call syntax): the projection fits the budget, these come on top of it."""


@dataclass(frozen=True)
class Summary:
    requests: int
    refused: int
    violations: int
    chars_sent: int
    chars_reused: int
    max_tokens_out: int
    newest_lost: int = 0
    unrestorable: int = 0
    over_window: int = 0

    @property
    def reuse(self) -> float:
        return self.chars_reused / self.chars_sent if self.chars_sent else 1.0

    @property
    def uncached(self) -> int:
        return self.chars_sent - self.chars_reused


def agent_requests(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Where the agent asked the model: before each assistant message after the first, and at the end."""
    ends = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
    if messages and messages[-1].get("role") != "assistant":
        ends.append(len(messages))
    return ends


def request_body(conversation: dict[str, Any], end: int) -> dict[str, Any]:
    """The agent's request before message ``end``: the history so far, its tools, its model."""
    body: dict[str, Any] = {"model": conversation.get("model") or "replay",
                            "messages": conversation["messages"][:end]}
    if conversation.get("tools"):
        body["tools"] = conversation["tools"]
    return body


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def conversation_problem(data: Any) -> str | None:
    """What keeps ``data`` from being a conversation to replay (``{"messages": [...], "tools"?: [...]}``), said
    so that the file can be fixed; None if it is one. Without it a JSON list, or a message without a role, ended in
    a traceback from deep in the replay."""
    shape = 'a conversation is a JSON object {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}'
    if not isinstance(data, dict):
        return f"the file holds a JSON {type(data).__name__}; {shape}"
    messages, tools = data.get("messages"), data.get("tools")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else "empty" if messages == [] else "not a list"
        return f'"messages" is {what}; {shape}'
    if tools is not None and not isinstance(tools, list):
        return f'"tools" is a JSON {type(tools).__name__}, not a list of tool definitions'
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            found = f"role {role!r}" if isinstance(message, dict) else f"a JSON {type(message).__name__}"
            return f"messages[{i}] has {found}; each message is an object whose role is one of {sorted(_ROLES)}"
    return None


def replay_settings(settings: Settings, window: int, root: Path) -> Settings:
    """``settings`` as a replay runs them: the window fixed, everything written under ``root`` (the journal, the
    mirror, the cut bodies' files when those are on), never incognito (its decisions must be readable)."""
    return dataclasses.replace(
        settings, data_dir=str(root), ctx_window=window, explicit=settings.explicit | {"ctx_window"},
        mirror_dir=str(root / "mirror_dir") if settings.mirror_dir else "",
        overflow_dir=str(root / "overflow_dir") if settings.overflow_dir else "", incognito=False,
        upstream="http://recording.invalid/v1")


def replay(conversation: dict[str, Any], settings: Settings, window: int, counter: MessageCounter | None = None,
           workdir: Path | None = None, upstream: RecordedUpstream | None = None,
           protocol: str = "chat") -> Iterator[ReplayStep]:
    """Replay ``conversation`` through the app. ``workdir``: its data dir (default: a temporary one, removed);
    ``upstream``: the recording's model, to read every body sent afterwards (default: a new one); ``protocol``:
    what the agent speaks, ``chat`` or ``responses`` (``proxy.edge.fronts.responses.spoken``)."""
    counter = counter or MessageCounter()
    if protocol == "responses":
        conversation = as_spoken(conversation)
    return iter(asyncio.run(_replay(conversation, settings, window, counter, workdir,
                                    upstream or RecordedUpstream(counter), protocol)))


def _request(protocol: str, body: dict[str, Any]) -> tuple[str, bytes]:
    """Where the agent sends ``body`` (a chat request), and how, in its ``protocol``."""
    if protocol == "responses":
        return "/v1/responses", orjson.dumps(responses_body(body))
    return "/v1/chat/completions", orjson.dumps(body)


async def _replay(conversation: dict[str, Any], settings: Settings, window: int, counter: MessageCounter,
                  workdir: Path | None, upstream: RecordedUpstream, protocol: str) -> list[ReplayStep]:
    messages = conversation["messages"]
    with _directory(workdir) as root, _ProblemLog() as problems:
        app = create_app(replay_settings(settings, window, root), httpx.ASGITransport(app=upstream))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://replay") as client:
            run = _Run(conversation, counter, window, open_journal(root / "journal.db", settings.journal_sync))
            try:
                steps = []
                for n, end in enumerate(agent_requests(messages)):
                    upstream.answer = messages[end] if end < len(messages) else LAST_ANSWER
                    before = len(upstream.sent)
                    path, content = _request(protocol, request_body(conversation, end))
                    response = await client.post(path, content=content, timeout=None)
                    sent = upstream.sent[before].body if len(upstream.sent) > before else None
                    steps.append(run.step(n, end, response, sent, problems.take()))
                return steps
            finally:
                run.journal.close()


@contextlib.contextmanager
def _directory(workdir: Path | None) -> Iterator[Path]:
    if workdir is not None:
        yield workdir
        return
    with tempfile.TemporaryDirectory(prefix="ctxproxy-replay-") as tmp:
        yield Path(tmp)


class _ProblemLog(logging.Handler):
    """The errors the proxy logs while a request is replayed (its invariant check failing among them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    def take(self) -> list[str]:
        taken, self.records = self.records, []
        return taken

    def __enter__(self) -> _ProblemLog:
        logging.getLogger("ctxproxy").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("ctxproxy").removeHandler(self)


class _Run:
    """What one replay carries from request to request: the previous upstream request, the decisions seen."""

    def __init__(self, conversation: dict[str, Any], counter: MessageCounter, window: int, journal: Journal) -> None:
        self.messages: list[dict[str, Any]] = conversation["messages"]
        self.hashes = [message_hash(m) for m in self.messages]
        self.counter, self.window, self.journal = counter, window, journal
        self.tools_in = counter.count_tools(conversation.get("tools"))
        self.previous: list[bytes] = []
        self.previous_tools = b""
        self.known: dict[str, int] = {}
        """Decisions already counted, per session."""

    def step(self, n: int, end: int, response: httpx.Response, sent: bytes | None,
             problems: list[str]) -> ReplayStep:
        refused = _refused(response)
        if response.status_code >= 400 and not refused:
            raise ReplayFailed(f"request {n} ({end} messages): the proxy answered {response.status_code}: "
                               f"{response.text[:2000]}")
        session = response.headers.get("x-ctx-session", "").encode("latin-1").decode("utf-8")
        decisions, new = self._decisions(session)
        incoming, hashes = self.messages[:end], self.hashes[:end]
        tokens_in = sum(self.counter.count(m, h) for m, h in zip(incoming, hashes, strict=True)) + self.tools_in
        kinds = dict(collections.Counter(str(d["kind"]) for d in new))
        if refused or sent is None:
            return ReplayStep(n, end, tokens_in, 0, 0, 0, False, True, kinds, tuple(problems))
        body = orjson.loads(sent)
        out, tools = body["messages"], orjson.dumps(body["tools"]) if body.get("tools") else b""
        encoded = [orjson.dumps(m) for m in out]
        same_tools = tools == self.previous_tools or not self.previous
        reused = _reused(self.previous, encoded) + (len(tools) if same_tools and self.previous else 0)
        kept = encoded[: len(self.previous)] == self.previous and same_tools
        tokens_out = sum(self.counter.count(m, message_hash(m)) for m in out) + self.counter.count_tools(
            body.get("tools"))
        problems += [f"tool call {cid} lost its pair" for cid in sorted(broken_pairs(out) - broken_pairs(incoming))]
        own = set(hashes)
        notices = sum(self.counter.count(m) for m in out if _notice(m) and message_hash(m) not in own)
        self.previous, self.previous_tools = encoded, tools
        return ReplayStep(n, end, tokens_in, tokens_out, sum(map(len, encoded)) + len(tools), reused, kept, False,
                          kinds, tuple(problems), _newest_lost(incoming, hashes, decisions),
                          self._unrestorable(session, new), tokens_out > self.window, notices)

    def _decisions(self, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The session's journaled decisions, and those of them this request added."""
        if not session:
            return [], []
        decisions = self.journal.decisions(session)
        new = decisions[self.known.get(session, 0):]
        self.known[session] = len(decisions)
        return decisions, new

    def _unrestorable(self, session: str, new: Sequence[dict[str, Any]]) -> int:
        missing = 0
        for d in new:
            if d["kind"] in _RESTORABLE:
                row = self.journal.overflow_body(d["overflow_id"], session)
                missing += row is None or sha256_text(row["body"]) != d["overflow_id"]
        return missing


def _notice(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return message.get("role") == "system" and isinstance(content, str) and content.startswith(NOTICE)


def _refused(response: httpx.Response) -> bool:
    if response.status_code != 400:
        return False
    try:
        return bool(orjson.loads(response.content)["error"]["code"] == REFUSED)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def _newest_lost(messages: Sequence[dict[str, Any]], hashes: Sequence[str],
                 decisions: Sequence[dict[str, Any]]) -> int:
    """Characters of the newest round's assistant and user text inside a fold or a hide in force."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages))
    gone = _gone(messages, hashes, decisions)
    return sum(len(str(messages[i].get("content") or "")) for i in range(last, len(messages))
               if i in gone and messages[i].get("role") in ("user", "assistant"))


def _gone(messages: Sequence[dict[str, Any]], hashes: Sequence[str], decisions: Sequence[dict[str, Any]]) -> set[int]:
    """Indices the newest fold and every hide stand for, where their span is still the one they were made for."""
    folds = [d for d in decisions if d["kind"] == "fold"]
    spans = folds[-1:] + [d for d in decisions if d["kind"] == "hide"]
    if not spans:
        return set()
    where = {mid: i for i, mid in enumerate(message_ids(messages, hashes))}
    gone: set[int] = set()
    for d in spans:
        start = where.get(d["target"], -1)
        end = start + int(d["count"])
        if start >= 0 and end <= len(messages) and sha256_text("".join(hashes[start:end])) == d["message_hash"]:
            gone.update(range(start, end))
    return gone


def _reused(previous: list[bytes], sent: list[bytes]) -> int:
    total = 0
    for a, b in zip(previous, sent, strict=False):
        if a != b:
            break
        total += len(a)
    return total


def summarize(steps: Sequence[ReplayStep]) -> Summary:
    forwarded = [s for s in steps if not s.refused]
    return Summary(len(steps), len(steps) - len(forwarded), sum(len(s.violations) for s in steps),
                   sum(s.chars_sent for s in forwarded), sum(s.chars_reused for s in forwarded),
                   max((s.tokens_out for s in forwarded), default=0), sum(s.newest_lost for s in forwarded),
                   sum(s.unrestorable for s in forwarded), sum(s.over_window for s in forwarded))
