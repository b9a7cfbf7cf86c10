"""Every shared trajectory through ``/v1/messages``: the chat route's guarantees, per protocol.

Why: issue #14's "done when" asks that the shared trajectories, converted to each protocol, replay with the same
guarantees as today (0 over the window, 0 broken pairs) and that prefix reuse be reported per protocol. Each
agent request of each ``*.native.json`` trajectory is converted to an Anthropic Messages request (the system
prompt apart, tool calls as ``tool_use`` blocks, results as ``tool_result`` blocks) and sent through the real
app, in process, the recording answering as the model (``proxy.commands.recording``), exactly as ``ctxproxy replay``
does for the chat route:

- ``chat``: the original chat requests to ``/v1/chat/completions`` (the reference);
- ``anthropic translated``: to ``/v1/messages``, the upstream speaking chat: what it receives is measured as the
  chat route's is (prefix reuse over the chat bodies sent);
- ``anthropic native``: to ``/v1/messages`` with ``anthropic_upstream = "native"``, the upstream speaking
  Anthropic: prefix reuse over the Anthropic bodies sent, in the order an Anthropic prompt cache reads them
  (tools, system, messages: a tool list that changes, the context tools' offer, costs everything after it),
  tokens and pairs over their chat reading.

Run: ``CTXPROXY_TRAJECTORIES=DIR .venv/bin/python bench/fronts.py [--json FILE]`` (DIR: the recorded trajectories).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402

from ctxproxy.config import load_settings  # noqa: E402
from ctxproxy.proxy.commands.recording import LAST_ANSWER, RecordedUpstream, Sent, prompt_tokens  # noqa: E402
from ctxproxy.proxy.commands.replay import _Run, agent_requests, replay_settings, request_body, summarize  # noqa: E402
from ctxproxy.proxy.core import broken_pairs  # noqa: E402
from ctxproxy.proxy.core.tokens import MessageCounter  # noqa: E402
from ctxproxy.proxy.edge.app import create_app  # noqa: E402
from ctxproxy.proxy.edge.fronts.anthropic.encode import CARRIER  # noqa: E402
from ctxproxy.proxy.edge.fronts.anthropic.native import native_chat  # noqa: E402
from ctxproxy.store import open_journal  # noqa: E402
from tests.workloads import trajectories_dir  # noqa: E402

WINDOWS = (8192, 32768)
MODES = ("chat", "anthropic translated", "anthropic native")


def anthropic_request(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat request as an Anthropic client sends it."""
    messages: list[dict[str, Any]] = []
    system = None
    for n, m in enumerate(chat["messages"]):
        if m["role"] == "system" and n == 0:
            system = m.get("content")
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m.get("tool_call_id"), "content": m.get("content") or ""}
            _add(messages, "user", block, merge=bool(messages) and _results_only(messages[-1]))
        else:
            _add_message(messages, m)
    out: dict[str, Any] = {"model": chat.get("model"), "max_tokens": 1024, "messages": messages}
    if system is not None:
        out["system"] = system
    if chat.get("tools"):
        out["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                         "input_schema": t["function"].get("parameters") or {"type": "object"}} for t in chat["tools"]]
    return out


def _results_only(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return message["role"] == "user" and isinstance(content, list) and all(
        b.get("type") == "tool_result" for b in content)


def _add(messages: list[dict[str, Any]], role: str, block: dict[str, Any], merge: bool) -> None:
    if merge:
        messages[-1]["content"].append(block)
    else:
        messages.append({"role": role, "content": [block]})


def _add_message(messages: list[dict[str, Any]], m: dict[str, Any]) -> None:
    content = m.get("content")
    if m["role"] == "assistant":
        blocks = [] if content is None else [{"type": "text", "text": content if isinstance(content, str) else
                                              "".join(p.get("text", "") for p in content)}]
        blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": _input(c["function"].get("arguments"))} for c in m.get("tool_calls") or []]
        messages.append({"role": "assistant", "content": blocks})
    elif messages and _results_only(messages[-1]) and m["role"] == "user" and isinstance(content, str):
        messages[-1]["content"].append({"type": "text", "text": content})
    else:
        messages.append({"role": m["role"], "content": content if content is not None else ""})


def _input(arguments: str | None) -> Any:
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


class NativeRecording(RecordedUpstream):
    """The recording as an Anthropic upstream: it reads each ``/v1/messages`` body as chat to count it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/messages"):
            return await super().__call__(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        chat = _chat_of(orjson.loads(body))
        prompt = prompt_tokens(chat, self.counter)
        self.sent.append(Sent(body, prompt))
        answer = self.answer
        blocks = ([{"type": "text", "text": answer["content"]}] if answer.get("content") else []) + [
            {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(
                c["function"].get("arguments"))} for c in answer.get("tool_calls") or []]
        payload = orjson.dumps({"id": "msg_replay", "type": "message", "role": "assistant", "model": "m",
                                "content": blocks, "stop_reason": "tool_use" if answer.get("tool_calls") else
                                "end_turn", "usage": {"input_tokens": prompt, "output_tokens": 1}})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def _chat_of(body: dict[str, Any]) -> dict[str, Any]:
    chat = native_chat(body)
    chat["messages"] = [{k: v for k, v in m.items() if k != CARRIER} for m in chat["messages"]]
    return chat


async def run(conversation: dict[str, Any], window: int, mode: str, counter: MessageCounter) -> dict[str, Any]:
    env = {"CTXPROXY_ANTHROPIC_UPSTREAM": "native"} if mode == "anthropic native" else {}
    upstream = NativeRecording(counter) if mode == "anthropic native" else RecordedUpstream(counter)
    messages = conversation["messages"]
    with tempfile.TemporaryDirectory(prefix="ctxproxy-fronts-") as tmp:
        root = Path(tmp)
        app = create_app(replay_settings(load_settings(env=env), window, root), httpx.ASGITransport(app=upstream))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://fronts") as client:
            run = _Run(conversation, counter, window, open_journal(root / "journal.db", "normal"))
            native, steps = _Native(window), []
            try:
                for n, end in enumerate(agent_requests(messages)):
                    upstream.answer = messages[end] if end < len(messages) else LAST_ANSWER
                    before = len(upstream.sent)
                    chat = request_body(conversation, end)
                    path, body = ("/v1/chat/completions", chat) if mode == "chat" else (
                        "/v1/messages", anthropic_request(chat))
                    response = await client.post(path, content=orjson.dumps(body), timeout=None)
                    sent = upstream.sent[before] if len(upstream.sent) > before else None
                    if mode == "anthropic native":
                        native.step(response, sent, messages[:end])
                    else:
                        steps.append(run.step(n, end, _as_chat_error(response, sent), sent.body if sent else None,
                                              []))
            finally:
                run.journal.close()
    return native.report() if mode == "anthropic native" else _report(summarize(steps))


def _as_chat_error(response: httpx.Response, sent: Sent | None) -> httpx.Response:
    """An Anthropic refusal (a 400 with nothing forwarded) in the chat envelope ``proxy.commands.replay`` recognises."""
    if response.status_code == 400 and sent is None and response.json().get("type") == "error":
        return httpx.Response(400, json={"error": {"code": "context_length_exceeded", "message": "",
                                                   "type": "invalid_request_error"}})
    return response


class _Native:
    """The native runs' figures: reuse over the Anthropic bodies, tokens and pairs over their chat reading."""

    def __init__(self, window: int) -> None:
        self.window, self.previous = window, list[bytes]()
        self.requests = self.refused = self.over = self.broken = self.sent_chars = self.reused = self.largest = 0

    def step(self, response: httpx.Response, sent: Sent | None, incoming: list[dict[str, Any]]) -> None:
        self.requests += 1
        if sent is None:
            assert response.status_code == 400, response.text
            self.refused += 1
            return
        body = orjson.loads(sent.body)
        # Anthropic's prompt cache reads tools, then system, then messages: a changed tool list (the offer)
        # invalidates everything after it
        parts = [orjson.dumps(body.get("tools")), orjson.dumps(body.get("system"))]
        parts += [orjson.dumps(m) for m in body["messages"]]
        same = next((i for i, (a, b) in enumerate(zip(self.previous, parts, strict=False)) if a != b),
                    min(len(self.previous), len(parts)))
        self.reused += sum(map(len, parts[:same]))
        self.sent_chars += sum(map(len, parts))
        self.previous = parts
        self.over += sent.prompt_tokens > self.window
        self.largest = max(self.largest, sent.prompt_tokens)
        self.broken += len(broken_pairs(_chat_of(body)["messages"]) - broken_pairs(incoming))

    def report(self) -> dict[str, Any]:
        return {"requests": self.requests, "refused": self.refused, "over_window": self.over,
                "broken_pairs": self.broken, "largest_sent": self.largest,
                "reuse": round(self.reused / self.sent_chars, 4) if self.sent_chars else 1.0}


def _report(s: Any) -> dict[str, Any]:
    return {"requests": s.requests, "refused": s.refused, "over_window": s.over_window, "broken_pairs": s.violations,
            "largest_sent": s.max_tokens_out, "reuse": round(s.reuse, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    corpus = trajectories_dir()
    if corpus is None:
        sys.exit("Set CTXPROXY_TRAJECTORIES to the shared trajectories' directory.")
    counter, rows = MessageCounter(), []
    for window in WINDOWS:
        for mode in MODES:
            totals: dict[str, Any] = {}
            for path in sorted(corpus.glob("*.native.json")):
                got = asyncio.run(run(json.loads(path.read_text()), window, mode, counter))
                for key, value in got.items():
                    totals.setdefault(key, []).append(value)
            row = {"window": window, "mode": mode, **{k: max(v) if k == "largest_sent" else sum(v)
                                                      for k, v in totals.items() if k != "reuse"},
                   "mean_reuse": round(sum(totals["reuse"]) / len(totals["reuse"]), 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
