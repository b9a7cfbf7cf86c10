"""One stub grammar (issue #11): every stub the core emits opens with the seed's
``[overflow id=… tool=… bytes=… call_id=… storage=…]`` line, and that line parses back as key=value whatever the
tool's name or command line and the call's id hold."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.fenced import builtin_presets
from ctxproxy.proxy.core.invariants import violations
from ctxproxy.proxy.core.state import Rules, sha256_text
from ctxproxy.proxy.core.stubs import argument_stub, elision_marker, parse_stub, program, spill_stub, stub_line
from ctxproxy.proxy.tools.apply import View, apply_intent
from ctxproxy.proxy.tools.intents import Drop
from tests.test_project import CharCounter, budget, run

STORAGES = st.sampled_from(["disk", "memory-only (incognito)"])
NAMES = st.text(min_size=0, max_size=30)


@given(NAMES, NAMES, STORAGES, st.text(min_size=1, max_size=2000))
@example("pytest -k 'a b'", "r3.1", "disk", "x")
@example('say "hi" ] x=1', "call 7]", "memory-only (incognito)", "y")
@example("ls\n-la", "id\u2028two", "disk", "z")
def test_every_stub_kind_opens_with_a_line_that_parses_back(tool: str, call_id: str, storage: str,
                                                             body: str) -> None:
    oid = sha256_text(body)
    stubs = [stub_line(oid, tool, len(body.encode()), call_id, storage),
             spill_stub(oid, tool, call_id, storage, body, 100, 50),
             elision_marker(oid, tool, call_id, storage, body, json.dumps({"command": tool})),
             argument_stub(oid, tool, call_id, storage, body, "content", "/ws/.overflow")]
    for stub in stubs:
        fields = parse_stub(stub.splitlines()[0])
        assert fields == {"id": oid, "tool": program(tool), "bytes": str(len(body.encode())), "call_id": call_id,
                          "storage": storage}


def test_a_command_line_is_reduced_to_its_program() -> None:
    assert program("cd /repo && python -m pytest -x") == "cd"
    assert program("/usr/bin/python3 x.py") == "python3"
    assert program("read_file") == "read_file"


_OPENING = re.compile(r"\[overflow ")


def _stub_lines(messages: list[dict[str, Any]]) -> list[str]:
    """Every line that opens a stub, in contents and inside call arguments."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    for m in messages:
        for call in m.get("tool_calls") or []:
            texts += [v for v in json.loads(call["function"]["arguments"]).values() if isinstance(v, str)]
    lines = []
    for text in texts:
        for match in _OPENING.finditer(text):
            lines.append(text[match.start():].split("\n", 1)[0])
    return lines


@given(st.lists(st.tuples(NAMES, NAMES, st.integers(0, 4000)), min_size=3, max_size=12), STORAGES)
@example([("bash", "call 1", 3000), ('ed "x"', "c]2", 3000), ("w", "c3", 10)], "disk")
def test_every_stub_a_native_projection_emits_parses(rounds: list[tuple[str, str, int]], storage: str) -> None:
    msgs: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for k, (tool, call_id, size) in enumerate(rounds):
        cid = f"{call_id}{k}"  # distinct ids
        args = json.dumps({"content": "a" * size})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": tool, "arguments": args}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": f"out {k}\n" * (size // 6)})
    rules = Rules(budget(4096, spill_chars=2500, keep_results=1), storage=storage)
    p = run(msgs, rules)
    state = p.state
    view = View(msgs, state, rules, CharCounter(), 20, "approval_id=\\S+", 0)
    drop = apply_intent(Drop(tuple(str(msgs[i].get("tool_call_id")) for i in state.tool_indices)), view)
    lines = _stub_lines(p.messages) + [d.replacement.split("\n", 1)[0] for d in drop.decisions]
    assert all(parse_stub(line) is not None for line in lines), lines
    assert violations(msgs, p.messages) == []  # argument cuts among them: calls intact, pairs kept
    assert run(msgs, rules, list(p.new)).messages == p.messages  # re-applied from the journal: the same bytes


@given(st.lists(st.tuples(st.text(min_size=1, max_size=40).filter(lambda t: "`" not in t), st.integers(0, 5000)),
                min_size=3, max_size=10))
@example([("pytest -k 'case 1' ]", 5000), ("ls", 10), ("cat a", 3000)])
def test_every_stub_a_fenced_projection_emits_parses(rounds: list[tuple[str, int]]) -> None:
    msgs: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for k, (command, size) in enumerate(rounds):
        msgs.append({"role": "assistant", "content": f"Step {k}.\n```bash\n{command}\n```"})
        msgs.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{'o' * size}\n</output>"})
    p = run(msgs, Rules(budget(4096, spill_chars=2500, keep_tool_rounds=1), fenced=builtin_presets()))
    assert all(parse_stub(line) is not None for line in _stub_lines(p.messages))


def test_old_decisions_render_as_they_were_stored() -> None:
    """A stub is journaled text: a decision made before this grammar re-applies byte for byte."""
    msgs: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "x" * 3000}]
    from ctxproxy.proxy.core.identity import message_hash

    old = "[overflow id=" + "0" * 64 + " tool=? bytes=3000 call_id=c1 storage=disk]\nCut by you in the mirror."
    decision = Decision("drop", "tool:c1", message_hash(msgs[3]), old, "0" * 64, source="model")
    assert run(msgs, Rules(budget(131072)), [decision]).messages[3]["content"] == old


_LINES = st.lists(st.text(st.sampled_from(" \t\u3000ab\r\n\x0b\x0c\x1c\x85\u2028é"), max_size=12),
                  max_size=6).map("".join)
"""Texts broken by every separator ``str.splitlines`` knows, with blank lines and Unicode spaces; lines shorter
than a preview clips."""


@given(_LINES)
@example("\n \n  first  \n\n last\t\n \n")
def test_a_preview_is_the_first_and_last_non_blank_line_however_the_text_breaks(text: str) -> None:
    """Issue #13: the preview is found by scanning in from each end, not by stripping every line of the result;
    it is what it was: the first and last non-blank lines (``str.splitlines``), stripped."""
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
    marker = elision_marker("0" * 64, "bash", "c1", "disk", text, "")
    assert f'"{lines[0]}" … "{lines[-1]}"' in marker
