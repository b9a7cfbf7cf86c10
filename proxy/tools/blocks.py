"""The context tools for text-protocol agents: a fenced ``context`` block in the assistant's text (issue #5).

An agent without function calling cannot receive tool schemas, so on the fenced route the proxy adds a note with
the call syntax, and the model writes one JSON call per block::

    ```context
    {"tool": "context_drop", "handles": ["r3.1"]}
    ```

``extract_blocks`` takes the blocks out of the answer's text (the agent never sees them) and turns them into calls
of the same shape as native ones, so the same runner executes them. Their results come back to the model as one
results message.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["NOTE", "RESTORE_NOTE", "extract_blocks", "has_command", "results_message"]

_BLOCK = re.compile(r"```context[ \t]*\n(?P<call>.*?)\n?```[ \t]*\n?", re.S)
_FENCE = re.compile(r"```")
_UNCLOSED = re.compile(r"```context[ \t]*\n(?:(?!```).)*\Z", re.S)
"""A block the answer never closed (cut off by max_tokens): the proxy's, not the agent's; dropped."""

NOTE = ("[ctxproxy] You can manage your own context. Write a fenced block tagged `context` holding one JSON call, "
        'e.g.\n```context\n{"tool": "context_status"}\n```\nTools: context_status {top}, context_pin {handles | '
        "snippet}, context_unpin {handles | snippet | all}, context_drop {handles}, context_note {handles, note}, "
        "read_overflow {id, offset, limit, grep}, ctx {action: status | clear | commit, call_ids, before, keep_last, "
        "tool}. "
        "A handle is r<round>.<i> (the i-th result of that round) or "
        "r<round> (all of them). The block is taken out of your message and its result comes back to you.")

RESTORE_NOTE = ("[ctxproxy] Some content was cut from your context; each [overflow id=...] stub says where. To read "
                "it back, write a fenced block tagged `context` holding one JSON call, e.g.\n```context\n"
                '{"tool": "read_overflow", "id": "<the id in the stub>", "grep": "error"}\n```\n'
                "(also offset, limit). The block is taken out of your message and the content comes back to you.")
"""On the fenced route, from the session's first stub on, when the full NOTE is not offered."""


def extract_blocks(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``text`` without its context blocks, and their calls in the native shape (name, JSON arguments)."""
    calls = []
    for n, match in enumerate(_BLOCK.finditer(text)):
        calls.append({"id": f"ctx_block_{n}", "type": "function", "function": _function(match.group("call"))})
    return _UNCLOSED.sub("", _BLOCK.sub("", text)), calls


def _function(raw: str) -> dict[str, Any]:
    try:
        call = json.loads(raw)
    except json.JSONDecodeError:
        return {"name": "context_block", "arguments": raw}  # an unknown name: the model is told what to fix
    if not isinstance(call, dict):
        return {"name": "context_block", "arguments": raw}
    name = call.pop("tool", None) or call.pop("name", None) or "context_block"
    arguments = call.pop("arguments", call)
    return {"name": str(name), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}


def has_command(text: str) -> bool:
    """Whether what is left of the answer still holds a fenced block (the agent's own command)."""
    return bool(_FENCE.search(text))


def results_message(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The context calls' results as the next user message of a text-protocol conversation."""
    parts = [f"[{r['tool_call_id']}]\n{r['content']}" for r in results]
    return {"role": "user", "content": "[ctxproxy] Context tool results:\n\n" + "\n\n".join(parts)}
