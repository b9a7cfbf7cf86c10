"""The live mirror (the second seed): the projection as ``LIVE_CONTEXT.json``, edited by the model, committed.

When auto-elision alone cannot bring a request under the target, the proxy writes what the model sees as a JSON
file and tells it that it manages its context: it edits the file with its own tools — it may remove or shorten
tool results, nothing else — and calls ``ctx`` with ``{"action": "commit"}``. ``revise`` validates the draft
against the projection (a removed or changed user block, system message or assistant text is refused with the
reason; a call and its result go together) and turns it into decisions: each removed result becomes a stub, each
shortened one keeps the model's text and a stub line, all restorable. Pure: the runner reads and writes the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config import Settings
from proxy.rewrite.decisions import Decision, OverflowWrite
from proxy.rewrite.identity import content_text
from proxy.rewrite.state import sha256_text
from proxy.rewrite.stubs import stub_line

__all__ = ["PARAGRAPH", "Revision", "maintenance_rounds", "mirror_document", "mirror_path", "revise"]

_FILE_TOOL = re.compile(r"read|view|open|cat|edit|write|create|patch|replace|insert", re.I)
_SHELL_TOOL = re.compile(r"bash|shell|run|exec|terminal|command|python", re.I)

PARAGRAPH = ("[ctxproxy] You manage your context: it no longer fits by the automatic rules alone. What you see is "
             "mirrored in {path}. Before you cut anything, write the decisions you have made so far as a note "
             "starting with DECIDED: (context_note): the rules protect the dialogue, not your memory. Then edit "
             "the file with your own tools — remove or shorten tool results (entries with role \"tool\"); leave "
             "every other entry as it is — and call ctx with {{\"action\": \"commit\"}}. The confirmation comes "
             "as the next system line.")


def mirror_path(settings: Settings, session_id: str) -> Path:
    """Where a session's LIVE_CONTEXT.json goes: under ``mirror_dir`` (the agent's workspace) or the data dir."""
    folder = Path(settings.mirror_dir) if settings.mirror_dir else settings.data_path / "mirror" / session_id
    return folder / "LIVE_CONTEXT.json"


def mirror_document(session: str, revision: int, ids: Sequence[str], messages: Sequence[dict[str, Any]]) -> str:
    """The projection as the model sees it, one entry per message, each with the identity a revision keys on."""
    entries = [{"id": mid, **{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "tool_calls")}}
               for mid, m in zip(ids, messages, strict=True)]
    return json.dumps({"session": session, "revision": revision, "messages": entries}, indent=1, ensure_ascii=False)


@dataclass(frozen=True)
class Revision:
    ok: bool
    text: str
    decisions: tuple[Decision, ...] = ()
    writes: tuple[OverflowWrite, ...] = ()


def revise(draft_text: str, ids: Sequence[str], hashes: Sequence[str], originals: Sequence[dict[str, Any]],
           current: Sequence[dict[str, Any] | None], storage: str, written: Mapping[str, str]) -> Revision:
    """The draft's cuts as decisions, or the reason it is refused (nothing is applied then). ``written``: each
    entry's text as the mirror gave it (identity → text); the draft is judged against that, not against what the
    projection became since, and messages newer than the mirror are not the draft's business."""
    try:
        draft = {e["id"]: e for e in json.loads(draft_text)["messages"] if isinstance(e, dict) and "id" in e}
    except (ValueError, KeyError, TypeError) as exc:
        return Revision(False, f"ctx commit: the mirror is not the JSON the proxy wrote ({exc}). Nothing applied.")
    unknown = sorted(set(draft) - set(ids))
    if unknown:
        return Revision(False, f"ctx commit: refused, the draft names messages that are not in your context: "
                               f"{', '.join(unknown[:5])}. Nothing applied.")
    decisions, writes, problems = [], [], []
    for mid, message_hash, original, now in zip(ids, hashes, originals, current, strict=True):
        if now is None or mid not in written:
            continue  # folded, or newer than the mirror
        problem, decision, write = _one(mid, message_hash, original, now, written[mid], draft.get(mid), storage)
        problems += [problem] if problem else []
        decisions += [decision] if decision else []
        writes += [write] if write else []
    if problems:
        return Revision(False, "ctx commit: refused, nothing applied: " + "; ".join(problems[:5]) +
                        ". Only tool results may be removed or shortened; restore the rest and commit again.")
    if not decisions:
        return Revision(True, "ctx commit: the draft cuts nothing; nothing to apply.")
    return Revision(True, f"ctx commit: applied, {len(decisions)} tool result(s) cut.", tuple(decisions),
                    tuple(writes))


def maintenance_rounds(messages: Sequence[dict[str, Any]], spans: Sequence[tuple[int, int]],
                       filename: str) -> list[tuple[int, int]]:
    """The rounds that only read or edited the mirror with the agent's file tools: an assistant message with no
    text whose every call is a file tool naming ``filename``, and its results. A shell edit of the same file is
    not mirror maintenance (the second seed): it stays."""
    found = []
    for start, end in spans:
        message = messages[start]
        calls = message.get("tool_calls") or []
        if not calls or content_text(message.get("content")).strip():
            continue
        names = [str((c.get("function") or {}).get("name", "")) for c in calls]
        arguments = [str((c.get("function") or {}).get("arguments", "")) for c in calls]
        if all(_FILE_TOOL.search(n) and not _SHELL_TOOL.search(n) and filename in a for n, a in zip(names, arguments,
                                                                                                    strict=True)):
            found.append((start, end))
    return found


def _one(mid: str, message_hash: str, original: dict[str, Any], now: dict[str, Any], given: str,
         entry: dict[str, Any] | None, storage: str) -> tuple[str | None, Decision | None, OverflowWrite | None]:
    role = now.get("role")
    after = None if entry is None else content_text(entry.get("content"))
    if role != "tool":
        if entry is None:
            return f"the {role} message {mid} was removed", None, None
        if after != given:
            return f"the {role} message {mid} was changed", None, None
        if entry.get("tool_calls", now.get("tool_calls")) != now.get("tool_calls"):
            return f"the call arguments of {mid} were changed (not supported yet)", None, None
        return None, None, None
    if after == given:
        return None, None, None
    if after is not None and len(after) >= len(given):
        return f"the tool result {mid} was made longer, not cut", None, None
    body = content_text(original.get("content"))
    line = stub_line(sha256_text(body), "?", len(body.encode()), str(original.get("tool_call_id")), storage)
    kept = f"{after}\n" if after else ""
    text = f"{kept}{line}\nCut by you in the mirror. The original is restorable: read_overflow id={sha256_text(body)}."
    decision = Decision("drop", mid, message_hash, text, sha256_text(body), source="model")
    return None, decision, OverflowWrite(sha256_text(body), body, "?", str(original.get("tool_call_id")))
