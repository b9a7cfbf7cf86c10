"""Finding tool results in text-protocol histories: a generated run of every preset's agent, and what must never match.

The recorded runs of the real agents are replayed in ``tests/test_corpus.py`` when ``CTXPROXY_TRAJECTORIES`` names
them; these generated ones (``tests/transcripts.py``) come with the repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ctxproxy.proxy.core.fenced import builtin_presets, find_results, parse_preset, route_of
from tests.transcripts import FORMATS, transcript

FENCED = [f for f in FORMATS if f != "native"]


def test_every_preset_is_met_by_a_generated_run_or_a_shipped_template() -> None:
    from tests.test_templates import CASES

    assert set(FENCED) <= {p.name for p in builtin_presets()}
    assert {p.name for p in builtin_presets()} <= set(FENCED) | {c.preset for c in CASES}


@pytest.mark.parametrize("fmt", FENCED)
def test_every_results_message_of_a_run_is_found_in_its_wrapper_and_only_those(fmt: str) -> None:
    run = transcript(fmt)
    found = find_results(run.messages)
    cut = [(r.index, r.round, r.preset, tuple(run.messages[r.index]["content"][s.start:s.end] for s in r.segments))
           for r in found]
    assert cut == [(r.index, r.round, r.preset, r.bodies) for r in run.results]
    assert not {r.index for r in found} & set(run.persons)  # the person between rounds, mini-swe-agent's diff
    assert route_of(run.messages, None, "auto") == "fenced"


def test_a_native_run_is_routed_native_and_has_no_text_results() -> None:
    run = transcript("native")
    assert route_of(run.messages, run.conversation["tools"], "auto") == "native"
    assert route_of(run.messages, None, "auto") == "native"  # its tool messages say so even without the tools
    assert find_results(run.messages) == []


def test_the_presets_cut_exactly_the_result_and_keep_the_wrapper() -> None:
    mini = "<returncode>0</returncode>\n<output>\nline 1\nline 2\n</output>"
    swe = "big output here\n(Open file: n/a)\n(Current directory: /repo)\n(Interactive session: n/a)\nbash-$"
    cline = "[read_file for 'a.py'] Result:\nprint(1)\n[execute_command for 'ls'] Result:\na.py b.py\n"
    generic = "Tool execution results:\nexit 0, 3 files"
    history: list[Any] = [{"role": "user", "content": "task"}]
    for content in (mini, swe, cline, generic):
        history += [{"role": "assistant", "content": "```\ncmd\n```"}, {"role": "user", "content": content}]
    found = find_results(history)
    bodies = [[history[r.index]["content"][s.start:s.end] for s in r.segments] for r in found]
    assert [r.preset for r in found] == ["mini-swe-agent", "swe-agent", "cline", "generic"]
    assert bodies == [["line 1\nline 2"], ["big output here"], ["print(1)", "a.py b.py"], ["exit 0, 3 files"]]
    assert [r.round for r in found] == [1, 2, 3, 4]


@pytest.mark.parametrize("content", [
    "Please look at the output again, it said <output>nothing</output>.",
    "Can you also check (Open file: n/a)? bash-$ seems stuck.",
    "[read_file for 'a.py'] Result: is what I expected, but go on.",
    "My observation: the tests are flaky.",
    "Observation: it still fails on CI.",
    "Tool results: look fine to me, go on.",
])
def test_a_person_typing_like_a_result_is_still_the_person(content: str) -> None:
    history = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "done?"},
               {"role": "user", "content": content}]
    assert find_results(history) == []


def test_results_only_count_right_after_the_assistant() -> None:
    result = "<returncode>0</returncode>\n<output>\nok\n</output>"
    history = [{"role": "user", "content": result}, {"role": "user", "content": result}]
    assert find_results(history) == []


def test_a_preset_from_the_settings_needs_a_body_group() -> None:
    preset = parse_preset("mine", r"RESULT>>\n(?P<body>.*)\n<<END")
    assert preset.segments("RESULT>>\nabc\n<<END") and preset.segments("other") is None
    with pytest.raises(ValueError, match="named group"):
        parse_preset("bad", r"RESULT (.*)")


def test_the_route_is_native_with_tools_and_can_be_forced() -> None:
    history = [{"role": "user", "content": "t"}, {"role": "assistant", "content": "x"},
               {"role": "user", "content": "<returncode>0</returncode>\n<output>\nok\n</output>"}]
    assert route_of(history, [{"type": "function"}], "auto") == "native"
    assert route_of(history, None, "auto") == "fenced"
    assert route_of([{"role": "user", "content": "hi"}], None, "auto") == "native"
    assert route_of([{"role": "user", "content": "hi"}], None, "fenced") == "fenced"
    assert len(builtin_presets()) == 10


def test_an_operators_preset_from_toml_is_tried_first(tmp_path: Path) -> None:
    from ctxproxy.config import SettingsError, load_settings
    from ctxproxy.proxy.core.fenced import presets_for

    path = tmp_path / "c.toml"
    path.write_text('[[fenced_presets]]\nname = "mine"\npattern = "RESULT>>\\\\n(?P<body>.*)\\\\n<<END"\n')
    settings = load_settings(path, {})
    presets = presets_for(settings.fenced_presets)
    assert presets[0].name == "mine" and len(presets) == 11
    history = [{"role": "user", "content": "t"}, {"role": "assistant", "content": "x"},
               {"role": "user", "content": "RESULT>>\nall good\n<<END"}]
    assert [r.preset for r in find_results(history, presets)] == ["mine"]
    path.write_text('[[fenced_presets]]\nname = "bad"\npattern = "no body group"\n')
    with pytest.raises(SettingsError, match="named group"):
        load_settings(path, {})
