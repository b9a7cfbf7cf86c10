"""A projection's decisions as journal rows (``proxy.engine.decided``): each names the forwarded message that holds
its replacement, found by first places looked up in dicts (issue #13), exactly where a walk finds them."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.state import State
from ctxproxy.proxy.engine.decided import _places, decision_rows

_NAMES = st.sampled_from(["a", "b", "c", "d", "e"])


def _walked(decisions: Sequence[Decision], state: State, hashes: Sequence[str]) -> dict[str, int]:
    """The places as the first version found them: each list walked from its start."""
    targets = {d.target for d in decisions if d.replacement}
    first: dict[str, int] = {}
    for i, mid in enumerate(state.ids):
        if mid in targets and mid not in first:
            first[mid] = i
    wanted = {state.out_hashes[i] for i in first.values() if i < len(state.out_hashes)}
    sent_at: dict[str, int] = {}
    for at, digest in enumerate(hashes):
        if digest in wanted and digest not in sent_at:
            sent_at[digest] = at
    return {mid: sent_at[state.out_hashes[i]] for mid, i in first.items()
            if i < len(state.out_hashes) and state.out_hashes[i] in sent_at}


@given(ids=st.lists(_NAMES, max_size=12), out_hashes=st.lists(_NAMES.map(str.upper), max_size=12),
       hashes=st.lists(_NAMES.map(str.upper), max_size=12),
       targets=st.lists(st.tuples(_NAMES, st.booleans()), max_size=6))
def test_each_decision_is_placed_where_walking_the_lists_places_it(
        ids: list[str], out_hashes: list[str], hashes: list[str], targets: list[tuple[str, bool]]) -> None:
    state = State()
    state.ids, state.out_hashes = ids, out_hashes
    decisions = [Decision("elide", target, replacement="marker" if replaced else "") for target, replaced in targets]
    assert _places(decisions, state, hashes) == _walked(decisions, state, hashes)


def test_a_decision_names_the_forwarded_message_whose_content_is_its_replacement() -> None:
    state = State()
    state.ids, state.out_hashes = ["m0", "m1", "m2"], ["h0", "x1", "x2"]
    sent = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "[marker]"},
            {"role": "tool", "content": "other"}]
    decisions = [Decision("elide", "m1", "h1", "[marker]"), Decision("elide", "m2", "h2", "[marker 2]")]
    rows = decision_rows(decisions, state, sent, ["h0", "x1", "x2"])
    assert rows[0]["replaced_by"] == "x1" and "replaced_by" not in rows[1]
