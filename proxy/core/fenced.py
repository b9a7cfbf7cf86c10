"""Text-protocol agents: finding the tool results inside the user messages that carry them (issue #5, part one).

Many agents on local models do not use function calling: the command sits in a fenced block of the assistant's
text, and its output comes back as the next user message, wrapped in the agent's own format. A preset knows one
such format and finds, inside a results message, the offsets of each result body (the "segments"); everything
around them is the wrapper, which is never cut. The presets know every observation template the released
mini-swe-agent (1.x, 2.x), SWE-agent (0.7, 1.x), OpenHands CodeAct (without function calling), Cline and Roo Code
render — normal output, no output, timeouts, output the agent cut to a head and a tail (two results), format
errors — plus a message opening with a line "Tool execution results:" alone (``generic``);
tests/test_templates.py renders each one as its agent does.

A person's message must never be mistaken for results: a user message counts only when it directly follows an
assistant message and matches a preset whole. One that follows an assistant message and that no preset knows is
not trusted whole either: ``proxy.core.project`` finds its largest block the way it finds a paste. Pure: no
I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Preset", "ResultsMessage", "Segment", "builtin_presets", "find_results", "parse_preset", "presets_for",
           "route_of", "text_of"]


@dataclass(frozen=True)
class Segment:
    """A result body inside a results message: ``content[start:end]``."""

    start: int
    end: int


@dataclass(frozen=True)
class Preset:
    name: str
    pattern: re.Pattern[str]
    """Matches a whole results message; its groups named ``body``, ``body2``… (those that took part) are the
    results; a match where none took part is a results message with nothing to cut ("no output", a timeout)."""
    repeat: bool = False
    """The pattern is a section header found repeatedly; each body runs to the next header or the end."""
    inner: re.Pattern[str] | None = None
    """``repeat`` only: the wrapper words inside a section (``Command executed.\nOutput:``), whose ``body`` group
    narrows the section to its result."""

    def segments(self, content: str) -> list[Segment] | None:
        if self.repeat:
            return _sections(self.pattern, content, self.inner)
        match = self.pattern.fullmatch(content)
        return _bodies(match, 0) if match else None


def _bodies(match: re.Match[str], default: int) -> list[Segment]:
    """The spans of the ``body*`` groups that took part, in order; none: one empty segment (nothing to cut)."""
    spans = sorted(match.span(name) for name in match.re.groupindex if name.startswith("body")
                   and match.start(name) >= 0)
    return [Segment(a, b) for a, b in spans] or [Segment(default, default)]


def _sections(header: re.Pattern[str], content: str, inner: re.Pattern[str] | None) -> list[Segment] | None:
    heads = list(header.finditer(content))
    if not heads or heads[0].start() != 0:
        return None
    ends = [h.start() for h in heads[1:]] + [len(content)]
    segments = []
    for head, end in zip(heads, ends, strict=True):
        match = inner.fullmatch(content, head.end(), end) if inner else None
        segments += _bodies(match, head.end()) if match else [Segment(head.end(), end)]
    return segments


_HEAD_TAIL = (r"<{tag}_head>\n(?P<body{a}>.*?)\n?</{tag}_head>\s*<elided_chars>\s*\d+ characters elided\s*"
              r"</elided_chars>\s*<{tag}_tail>\n(?P<body{b}>.*?)\n?</{tag}_tail>")
"""A long output cut by the agent itself: its head and its tail are two results, the notes between them wrapper."""


def _preset(name: str, *alternatives: str) -> Preset:
    return Preset(name, re.compile("|".join(f"(?:{a})" for a in alternatives), re.S))


@functools.cache
def builtin_presets() -> tuple[Preset, ...]:
    """The presets of the released agents' formats, compiled once, when first asked for: their ~40 expressions
    take 8-9 ms to compile, on the start path when they were compiled at import (the warm-up asks for them,
    ``proxy.engine.state``). Each pattern is the text a released agent renders; tests/test_templates.py renders
    every one of them."""
    return (*_mini_swe_agent(), *_swe_agent(), *_openhands_cline_and_generic())


def _mini_swe_agent() -> tuple[Preset, ...]:
    """mini-swe-agent's observations, timeouts and format errors."""
    return (
        # mini-swe-agent 1.x and 2.x text mode: config/*.yaml observation_template / action_observation_template
        _preset(
            "mini-swe-agent",
            r"(?:<exception>.*?</exception>\n)?<returncode>-?\d+</returncode>\n(?:"
            r"(?:<warning>.*?</warning>\n)?<output>\n?(?P<body>.*?)\n?</output>"
            r"|<warning>.*?</warning>\s*" + _HEAD_TAIL.format(tag="output", a=2, b=3)
            + r")(?:\s*<IMPORTANT>.*?</IMPORTANT>)*\s*"),
        _preset(  # mini-swe-agent 1.x: agents/default.py timeout_template
            "mini-swe-agent-timeout",
            r"The last command <command>.*?</command> timed out and has been killed\.\nThe output of the command was:\n"
            r"(?: ?<output>\n(?P<body>.*?)\n</output>"
            r"|<warning>Output was too long and has been truncated\.</warning>\n"
            + _HEAD_TAIL.format(tag="output", a=2, b=3)
            + r")\s*Please try another command and make sure to avoid those requiring interactive input\.\s*"),
        _preset(  # mini-swe-agent: format_error_template of each config (text mode, tool-call mode, output limit)
            "mini-swe-agent-format-error",
            r"(?:Format error:\n\n<error>\n(?P<body>.*?)\n</error>\n\nHere is general guidance on how to format your "
            r"response:\n\n)?Please always provide EXACTLY ONE action .*",
            r"Tool call error:\n\n<error>\n(?P<body2>.*?)\n</error>\n\nHere is general guidance on how to submit .*",
            r"Your previous response reached the output token limit \(finish_reason=\w+\) before you produced .*"),
    )


def _swe_agent() -> tuple[Preset, ...]:
    """SWE-agent's (0.7 and 1.x) observations and format errors."""
    return (
        _preset(  # SWE-agent 0.7 and the windowed configs: next_step_template / next_step_no_output_template
            "swe-agent",
            r"(?:Your command ran successfully and did not produce any output\.|(?P<body>.*?))\n?"
            r"\(Open file: [^\n]*\)\n\(Current directory: [^\n]*\)\n(?:\(Interactive session: [^\n]*\)\n)?bash-\$\s*"),
        _preset(  # SWE-agent 1.x: config/default*.yaml, bash_only.yaml, TemplateConfig's defaults (and OpenHands' own
            # "OBSERVATION:" of its CodeAct agent before function calling)
            "swe-agent-observation",
            r"OBSERVATION:\n(?P<body>.*?)(?:\n\[Last action has been rejected by the user\])?\s*",
            r"<observation>\n(?P<body2>.*?)\n?</observation>\s*",
            r"Observation: (?P<body3>.*?)<response clipped><NOTE>Observations should not exceeded \d+ characters\. "
            r"\d+ characters were elided\..*?</NOTE>\s*",
            r"<warning>\nThe output of your last command was too long\..*?</warning>\s*"
            + _HEAD_TAIL.format(tag="observation", a=4, b=5) + r"\s*",
            r"(?:<warning>\n)?Your (?:last )?command ran successfully and did not produce any output\."
            r"(?:\n</warning>)?\s*",
            r"(?:<warning>\n)?The command '.*?' was cancelled because it took more than \S+ seconds.*",
            r"Your bash command contained syntax errors and was NOT executed\..*?Here is the output of `bash -n`:\n"
            r"(?P<body6>.*)"),
        # SWE-agent 1.x: sweagent/tools/parsing.py error_message of each parse function, blocklist_error_template
        _preset(
            "swe-agent-format-error",
            r"(?:Your output was not formatted correctly\.|The command you provided was not recognized\.|"
            r"Your last output did not use any tool calls!|It seems like something went wrong with your output\.|"
            r"Your output could not be parsed as JSON\.|No bash code blocks were detected in your output\.|"
            r"We did not detect the right number of bash code blocks in your output\.|"
            r"No message found in model response\.).*",
            r"Operation '.*' is not supported by this environment\.\s*"),
    )


def _openhands_cline_and_generic() -> tuple[Preset, ...]:
    """OpenHands CodeAct's, Cline's and Roo Code's results, and a generic header."""
    return (
        # OpenHands CodeAct without function calling: llm/fn_call_converter.py, events/observation/commands.py,
        # runtime/utils/bash.py (timeouts), events/serialization/event.py (truncation)
        _preset(
            "openhands",
            r"EXECUTION RESULT of \[[^\]\n]+\]:\n(?:\[Below is the output of the previous command\.\]\n)?(?P<body>.*?)"
            r"(?:\n\[\.\.\. Observation truncated due to length \.\.\.\]\n(?P<body2>.*?))?"
            r"(?:\n\[(?:Current working directory: |Python interpreter: |Command finished with exit code |The command "
            r"has no new output after |The command timed out after |Error occurred in processing last action|"
            r"Last action has been rejected by the user)[^\n]*\])*\s*",
            r"(?P<body3>.*?)\n\[Error occurred in processing last action\]\s*"),
        # Cline and Roo Code: each tool's "[tool for '…'] Result:" block, then core/prompts/responses.ts's words
        Preset(
            "cline", re.compile(r"^\[[\w.-]+(?: for '[^'\n]*')?\] Result:[ \t]*\n", re.M), repeat=True,
            inner=re.compile(
                r"(?:Command executed[^\n]*\nOutput:\n|Command is still running in [^\n]*\n"
                r"(?:Here's the output so far:\n)?"
                r"|The tool execution failed with the following error:\n<error>\n|The user denied this operation and "
                r"provided the following feedback:\n<feedback>\n)?"
                r"(?:The user denied this operation\.|Command executed\.|(?P<body>.*?))"
                r"(?:\n</error>|\n</feedback>)?\s*", re.S)),
        _preset(  # Cline and Roo Code: responses.ts noToolsUsed, sent alone after an answer without a tool
            "cline-no-tool", r"\[ERROR\] You did not use a tool in your previous response!.*"),
        Preset("generic",
               re.compile(r"(?:tool execution results?|tool results?)[ \t]*:[ \t]*\n(?P<body>.+)", re.S | re.I)),
    )


def parse_preset(name: str, pattern: str) -> Preset:
    """A preset from the settings: ``pattern`` must match a whole results message and name its ``body``."""
    compiled = re.compile(pattern, re.S)
    if "body" not in compiled.groupindex:
        raise ValueError(f"preset {name!r}: the pattern needs a named group (?P<body>...) for the result")
    return Preset(name, compiled)


@dataclass(frozen=True)
class ResultsMessage:
    index: int
    """Position of the user message in the conversation."""
    round: int
    """The assistant round it answers: 1 for the first assistant message, and so on."""
    preset: str
    segments: tuple[Segment, ...]


def find_results(messages: Sequence[dict[str, Any]], presets: Sequence[Preset] | None = None) -> list[ResultsMessage]:
    """Every user message that carries the results of the assistant round before it, with its segments
    (``presets``: the built-in ones unless given)."""
    presets = builtin_presets() if presets is None else presets
    found, round_ = [], 0
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            round_ += 1
            continue
        if message.get("role") != "user" or i == 0 or messages[i - 1].get("role") != "assistant":
            continue
        content = text_of(message.get("content"))
        if content is None:
            continue
        for preset in presets:
            segments = preset.segments(content)
            if segments:
                found.append(ResultsMessage(i, round_, preset.name, tuple(segments)))
                break
    return found


def text_of(content: Any) -> str | None:
    """The text a preset reads: the string, or a list of text parts joined by newlines (Cline and Roo Code send
    each block of a results message as its own part: the ``[tool] Result:`` line, the output, the environment
    details). None for anything else (an image part, no content). A cut message goes out as this text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) and p.get("type") == "text"
                                                     and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


@functools.lru_cache(maxsize=32)
def presets_for(custom: tuple[tuple[str, str], ...]) -> tuple[Preset, ...]:
    """The operator's presets (tried first), then the built-in ones. Compiled once per configuration."""
    return (*(parse_preset(name, pattern) for name, pattern in custom), *builtin_presets())


def route_of(messages: Sequence[dict[str, Any]], tools: Any, setting: str,
             presets: Sequence[Preset] | None = None) -> str:
    """``native`` when the request carries tools or tool messages, ``fenced`` when a preset recognises its history
    (or the setting says so), else ``native``: a plain conversation has nothing to find."""
    if setting in ("native", "fenced"):
        return setting
    if tools or any(m.get("role") == "tool" for m in messages):
        return "native"
    return "fenced" if find_results(messages, presets) else "native"
