"""A projection's decisions as journal rows (``proxy.engine.decided``): a decision whose replacement is the whole
content of a forwarded message names that message, and is not stored with its text again."""

from __future__ import annotations

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.state import State
from ctxproxy.proxy.engine.decided import decision_rows


def test_a_decision_names_the_forwarded_message_whose_content_is_its_replacement() -> None:
    state = State()
    state.ids, state.out_hashes = ["m0", "m1", "m2", "m1"], ["h0", "x1", "x2", "x1"]
    sent = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "[marker]"},
            {"role": "tool", "content": "other"}]
    decisions = [Decision("elide", "m1", "h1", "[marker]"), Decision("elide", "m2", "h2", "[marker 2]"),
                 Decision("elide", "m9", "h9", "[gone]")]
    rows = decision_rows(decisions, state, sent, ["h0", "x1", "x2"])
    assert rows[0]["replaced_by"] == "x1"
    assert "replaced_by" not in rows[1] and "replaced_by" not in rows[2]
