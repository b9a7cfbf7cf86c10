"""``ctxproxy show`` in the operator's words: a session's rounds and what each one cut, not the journal's columns.

A round is one request of the agent (its number in the session, from 1); its cuts are the decisions its
projection made (``spill 2, elide 1``); its answer is what the agent got (``ok``, or the refusal or failure and its
status). The JSON form (``--json``) keeps every journal field and adds the same ``round`` and ``cuts``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ctxproxy.proxy.commands.tables import render_table

__all__ = ["rounds", "session_text"]

_ROUND_COLUMNS = [("round", "round"), ("when", "when"), ("messages", "messages"), ("prompt_tokens", "prompt tok"),
                  ("completion_tokens", "answer tok"), ("cut", "cuts"), ("answer", "answer"), ("attempts", "tries"),
                  ("total_ms", "ms")]
_ANSWERS = {"ok": "ok", "context_too_large": "refused: too long for the window",
            "client_disconnected": "agent went away", "unreachable": "upstream unreachable",
            "timeout": "upstream timed out", "interrupted": "interrupted (proxy stopped)"}


def rounds(entries: Sequence[Mapping[str, Any]], cuts: Mapping[int, Mapping[str, int]]) -> list[dict[str, Any]]:
    """The journal's rows as rounds: numbered, with their cuts, in the order the agent sent them."""
    return [dict(e) | {"round": n, "cuts": dict(cuts.get(e["request_id"], {}))} for n, e in enumerate(entries, 1)]


def session_text(session: Mapping[str, Any], numbered: Sequence[Mapping[str, Any]]) -> str:
    return _summary(session, numbered) + "\n\n" + render_table([_row(r) for r in numbered], _ROUND_COLUMNS)


def _summary(session: Mapping[str, Any], numbered: Sequence[Mapping[str, Any]]) -> str:
    parent = (f" (a fork of {session['parent_id']}, sharing its first {session.get('shared_len') or 0} messages)"
              if session.get("parent_id") else "")
    cut = sum(sum(r["cuts"].values()) for r in numbered)
    last = session.get("last_prompt_tokens")
    return "\n".join([
        f"Session {session['id']}{parent}, model {session.get('model') or '?'}",
        f"In all: {session['requests']} rounds, {session['messages']} messages now, {cut} cuts in the rounds shown; "
        f"{session.get('prompt_tokens') or 0:,} prompt and {session.get('completion_tokens') or 0:,} answer tokens "
        "upstream" + (f"; the last prompt was {last:,} tokens" if last else ""),
        f"started {session.get('created_at')}, last active {session.get('updated_at')}",
    ])


def _row(r: Mapping[str, Any]) -> dict[str, Any]:
    outcome = r.get("outcome")
    answer = _ANSWERS.get(outcome or "", outcome or "no answer yet")
    if outcome not in (None, "ok"):
        answer += f" ({r.get('status')})"
    when = str(r.get("received_at") or "")
    return {**r, "when": when[11:19] or when, "messages": f"+{r.get('new_messages') or 0} = {r.get('messages')}",
            "cut": ", ".join(f"{k} {v}" for k, v in r["cuts"].items()) or "-", "answer": answer}
