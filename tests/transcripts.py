"""Agent transcripts in every format the proxy recognises, generated here, with where their results are.

Why: the tests of the text-protocol route and of the replay must run from a bare clone, without the recorded
third-party runs (``CTXPROXY_TRAJECTORIES``). Each transcript is a chat body ``{"model", "messages", "tools"?}``
as the agent would send it at the end of its run, built from ``tests.workloads``' output shapes, plus the truth
the tests compare with: every results message, its round, the preset that must claim it and its result bodies
exactly. The quirks of the real runs are kept on purpose: a person typing between rounds in words that look like
a result's wrapper, SWE-agent's demonstration and task (results-shaped, yet after no assistant message),
mini-swe-agent's last user message (the submitted diff), a native run's parallel calls, an assistant
``content: null`` and a final call without its result.

Formats (``FORMATS``): ``native`` (OpenAI tool calls), and the presets of ``proxy/core/fenced.py``:
``mini-swe-agent``, ``swe-agent``, ``cline`` (Cline, Roo Code), ``generic``.

Run: ``python -m tests.transcripts --out DIR`` writes ``<format>.json`` for each.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.workloads import TOOLS, output

FORMATS = ("native", "mini-swe-agent", "swe-agent", "cline", "generic")
PERSON = ("Please also look at the <output> of the linter, it said <returncode>1</returncode> earlier.\n"
          "Observation: the nightly job (Open file: n/a) still fails. Tool results: not what I expected.")
"""A person's message right after an assistant message, dressed like every wrapper: never a result."""
TASK = "The nightly run fails on invoices dated at a month's end. Find the cause and fix it with a test."


@dataclass(frozen=True)
class Result:
    """A results message as ``find_results`` must report it, with the text of each segment."""

    index: int
    round: int
    preset: str
    bodies: tuple[str, ...]


@dataclass
class Transcript:
    format: str
    conversation: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    persons: list[int] = field(default_factory=list)
    """Indices of user messages that follow an assistant message yet are a person's (or the diff): never results."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.conversation["messages"]
        return messages


def _outputs(r: random.Random, rounds: int, big: int) -> list[tuple[str, dict[str, str], str]]:
    """Per round (tool, arguments, output): short outputs as most commands print, a long one in round ``big``."""
    sizes = [r.randint(12_000, 16_000) if k == big else r.randint(150, 2_500) for k in range(rounds)]
    return [(name, args, text.rstrip("\n") or "(no output)")
            for name, args, text in (output(r, k, size) for k, size in enumerate(sizes))]


def _command(name: str, args: dict[str, str]) -> str:
    return {"read_file": f"cat {args.get('path')}", "grep": f"grep -rn '{args.get('pattern')}' {args.get('path')}",
            "http_get": f"curl -s '{args.get('url')}'"}.get(name, args.get("command", name))


def _fenced(fmt: str, system: str, opening: list[dict[str, Any]], ask: Callable[[int, str], str],
            wrap: Callable[[str, str, int], tuple[str, tuple[str, ...]]], rounds: int, seed: int) -> Transcript:
    """A text-protocol run: per round the assistant's fenced command, then its wrapped output (or a person)."""
    r = random.Random(f"{fmt}-{seed}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, *opening]
    out = Transcript(fmt, {"model": "fake-model", "messages": messages})
    for k, (name, args, text) in enumerate(_outputs(r, rounds, big=rounds // 2)):
        messages.append({"role": "assistant", "content": ask(k, _command(name, args))})
        if k == 2:  # a person speaks up between rounds; the agent answers them, then goes on
            out.persons.append(len(messages))
            messages += [{"role": "user", "content": PERSON},
                         {"role": "assistant", "content": ask(k, _command(name, args))}]
        content, bodies = wrap(text, _command(name, args), k)
        out.results.append(Result(len(messages), sum(m["role"] == "assistant" for m in messages), fmt, bodies))
        messages.append({"role": "user", "content": content})
    return out


def mini_swe_agent(rounds: int, seed: int) -> Transcript:
    system = ("You are a helpful assistant that can interact with a computer.\nYour response must contain exactly "
              "ONE bash code block with ONE command.\n\n```mswea_bash_command\nyour_command_here\n```\n"
              "To finish, issue: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`")
    opening = [{"role": "user", "content": f"Please solve this issue: {TASK}"}]

    def ask(k: int, command: str) -> str:
        return f"THOUGHT: step {k + 1}, I need to see more.\n\n```mswea_bash_command\n{command}\n```"

    def wrap(text: str, _: str, k: int) -> tuple[str, tuple[str, ...]]:
        warning = "<warning>\nThe output of your last command was too long.\n</warning>\n" if k % 4 == 3 else ""
        status = 1 if k % 5 == 4 else 0
        return f"<returncode>{status}</returncode>\n{warning}<output>\n{text}\n</output>", (text,)
    out = _fenced("mini-swe-agent", system, opening, ask, wrap, rounds, seed)
    out.messages.append({"role": "assistant", "content": ask(rounds, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")})
    out.persons.append(len(out.messages))  # the submission: the diff, not a results message
    out.messages.append({"role": "user", "content": "diff --git a/billing/periods.py b/billing/periods.py\n"
                                                    "-    return date.replace(day=31)\n+    return last_day(date)\n"})
    return out


def swe_agent(rounds: int, seed: int) -> Transcript:
    system = "SETTING: You are an autonomous programmer working in a command line with a special interface."
    prompt = "\n(Open file: n/a)\n(Current directory: /billing)\nbash-$"
    demonstration = ("Here is a demonstration of how to solve a task:\n--- DEMONSTRATION ---\nfind . -name x.py\n"
                     "./x.py\n(Open file: n/a)\n(Current directory: /demo)\nbash-$")
    opening = [{"role": "user", "content": demonstration},
               {"role": "user", "content": f"We're currently solving the following issue: {TASK}{prompt}"}]

    def ask(k: int, command: str) -> str:
        return f"DISCUSSION\nStep {k + 1}: let us look further.\n\n```\n{command}\n```"

    def wrap(text: str, _: str, k: int) -> tuple[str, tuple[str, ...]]:
        session = "(Interactive session: n/a)\n" if k % 3 == 1 else ""
        return f"{text}\n(Open file: billing/periods.py)\n(Current directory: /billing)\n{session}bash-$", (text,)
    return _fenced("swe-agent", system, opening, ask, wrap, rounds, seed)


def cline(rounds: int, seed: int) -> Transcript:
    system = "You are Cline, a highly skilled software engineer. You use one tool per message, in XML tags."
    opening = [{"role": "user", "content": f"<task>\n{TASK}\n</task>"}]

    def ask(k: int, command: str) -> str:
        return (f"<thinking>Step {k + 1}.</thinking>\n"
                f"<execute_command>\n<command>{command}</command>\n</execute_command>")

    def wrap(text: str, command: str, k: int) -> tuple[str, tuple[str, ...]]:
        command = command.replace("'", '"')  # Cline's header quotes the command; the preset reads up to a quote
        first = f"Command executed.\nOutput:\n{text}\n"  # the output is cut, Cline's words and the trailing blanks stay
        if k % 3 != 1:
            return f"[execute_command for '{command}'] Result:\n{first}", (text.rstrip(),)
        second = "The user has approved the change."  # two tools answered in one message (Roo Code)
        return (f"[execute_command for '{command}'] Result:\n{first}[write_to_file for 'billing/periods.py'] Result:"
                f"\n{second}\n"), (text.rstrip(), second)
    return _fenced("cline", system, opening, ask, wrap, rounds, seed)


def generic(rounds: int, seed: int) -> Transcript:
    system = "You are a coding agent. Put each shell command in a ```bash block; its output comes back to you."
    opening = [{"role": "user", "content": TASK}]

    def ask(k: int, command: str) -> str:
        return f"Next, step {k + 1}:\n```bash\n{command}\n```"

    def wrap(text: str, _: str, k: int) -> tuple[str, tuple[str, ...]]:
        head = "Tool execution results:" if k % 2 else "Tool results:"
        return f"{head}\n{text}", (text,)
    return _fenced("generic", system, opening, ask, wrap, rounds, seed)


def native(rounds: int, seed: int) -> Transcript:
    """OpenAI tool calls; round 2 calls two tools at once, odd rounds carry ``content: null``, the run ends with a
    call that has no result yet (the agent's final submit)."""
    r = random.Random(f"native-{seed}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent with tools."},
                                      {"role": "user", "content": TASK}]
    outputs = _outputs(r, rounds + 1, big=rounds // 2)
    k = 0
    while k < rounds:
        width = 2 if k == 2 else 1
        calls = [{"id": f"call_{k + j:03d}", "type": "function",
                  "function": {"name": outputs[k + j][0], "arguments": json.dumps(outputs[k + j][1])}}
                 for j in range(width)]
        messages.append({"role": "assistant", "content": None if k % 2 else f"Round {k + 1}.", "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": outputs[k + j][2]}
                     for j, c in enumerate(calls)]
        k += width
    messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": "call_submit", "type": "function",
                     "function": {"name": "run_shell", "arguments": json.dumps({"command": "submit"})}}]})
    return Transcript("native", {"model": "fake-model", "tools": TOOLS, "messages": messages})


BUILDERS: dict[str, Callable[[int, int], Transcript]] = {
    "native": native, "mini-swe-agent": mini_swe_agent, "swe-agent": swe_agent, "cline": cline, "generic": generic}


def transcript(fmt: str, rounds: int = 14, seed: int = 7) -> Transcript:
    """One agent run of ``rounds`` rounds in format ``fmt`` (one of ``FORMATS``); the same for the same seed."""
    return BUILDERS[fmt](rounds, seed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="a directory; <format>.json is written there")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for fmt in FORMATS:
        path = args.out / f"{fmt}.json"
        path.write_text(json.dumps(transcript(fmt, args.rounds, args.seed).conversation, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
