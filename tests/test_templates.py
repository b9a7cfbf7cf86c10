"""Every observation template the text-protocol agents ship, rendered the way the agent renders it, is recognised
by a preset of ``proxy.core.fenced``: each result body inside it is a cuttable segment, the wrapper words stay.

mini-swe-agent's templates are read from the installed package's own config YAMLs and rendered with jinja2 as its
``format_observation_messages`` / ``parse_regex_actions`` do. The others are transcribed below, each with the file
it comes from, and rendered as that agent does (jinja2 for SWE-agent, the f-strings' concatenation for OpenHands,
the template strings for Cline and Roo Code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from jinja2 import StrictUndefined, Template

from ctxproxy.proxy.core.fenced import find_results
from ctxproxy.proxy.core.segments import compose, wrapper_intact

OUT = "".join(f"line {i}: some output of the command\n" for i in range(40))
LONG = "".join(f"row {i:05d} " + "x" * 50 + "\n" for i in range(400))  # 24 400 characters


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    render: Callable[[], str]
    bodies: tuple[str, ...]
    """The result bodies the preset must find (newlines at their ends aside); () for a message with none."""
    words: tuple[str, ...]
    """Wrapper words that must stay when every body is cut."""


def jinja(template: str, **variables: Any) -> str:
    return Template(template, undefined=StrictUndefined).render(**variables)


# --- mini-swe-agent ----------------------------------------------------------------------------------------------
MSWEA_CONFIG = Path(__import__("minisweagent").__file__).parent / "config"


def mswea(config: str, key: str, **variables: Any) -> Callable[[], str]:
    def render() -> str:
        template = yaml.safe_load((MSWEA_CONFIG / config).read_text())["model"][key]
        return jinja(template, **variables)
    return render


def observation(output: str, returncode: int = 0, exception_info: str = "") -> dict[str, Any]:
    return {"output": output, "returncode": returncode, "exception_info": exception_info}


# mini-swe-agent 1.x, src/minisweagent/agents/default.py (v1.17.5), AgentConfig.timeout_template.
MSWEA_V1_TIMEOUT = (
    "The last command <command>{{action['action']}}</command> timed out and has been killed.\n"
    "The output of the command was:\n"
    "{% if output | length < 10000 -%}\n"
    "<output>\n{{output}}\n</output>\n"
    "{%- else -%}\n"
    "<warning>Output was too long and has been truncated.</warning>\n"
    "<output_head>\n{{ output[:5000] }}\n</output_head>\n"
    "<elided_chars>{{ output | length - 10000 }} characters elided</elided_chars>\n"
    "<output_tail>\n{{ output[-5000:] }}\n</output_tail>\n"
    "{%- endif %}\n"
    "Please try another command and make sure to avoid those requiring interactive input."
)
# mini-swe-agent 1.0–1.3, src/minisweagent/agents/default.py, the first timeout_template (" <output>").
MSWEA_V1_0_TIMEOUT = (
    "The last command <command>{{action['action']}}</command> timed out and has been killed.\n"
    "The output of the command was:\n <output>\n{{output}}\n</output>\n"
    "Please try another command and make sure to avoid those requiring interactive input."
)
# mini-swe-agent, models/litellm_textbased_model.py and 1.x agents/default.py: the default format_error_template.
MSWEA_FORMAT_DEFAULT = "Please always provide EXACTLY ONE action in triple backticks, found {{actions|length}} actions."
PROGRAMBENCH = dict(step_limit=100, n_model_calls=95, wall_time_limit_seconds=3600, elapsed_seconds=3300)
FORMAT = dict(actions=[], error="Expected exactly 1 action, found 0.")

MSWEA_CASES = [
    Case("mini textbased: output", "mini-swe-agent",
         mswea("mini_textbased.yaml", "observation_template", output=observation(OUT)), (OUT,),
         ("<returncode>0</returncode>", "<output>", "</output>")),
    Case("mini textbased: no output", "mini-swe-agent",
         mswea("mini_textbased.yaml", "observation_template", output=observation("", 1)), (),
         ("<returncode>1</returncode>",)),
    Case("mini textbased: long output, head and tail", "mini-swe-agent",
         mswea("mini_textbased.yaml", "observation_template", output=observation(LONG)), (LONG[:5000], LONG[-5000:]),
         ("The output of your last command was too long.", "<output_head>", "</output_head>",
          f"{len(LONG) - 10000} characters elided", "<output_tail>", "</output_tail>")),
    Case("mini textbased: timeout (exception_info)", "mini-swe-agent",
         mswea("mini_textbased.yaml", "observation_template", output=observation(
             OUT, -1, "An error occurred while executing the command: Command 'sleep 99' timed out after 30 seconds")),
         (OUT,), ("<exception>An error occurred while executing the command", "<returncode>-1</returncode>")),
    Case("default.yaml: long output", "mini-swe-agent",
         mswea("default.yaml", "observation_template", output=observation(LONG, 2)), (LONG[:5000], LONG[-5000:]),
         ("<returncode>2</returncode>", "characters elided")),
    Case("benchmarks/swebench.yaml: output", "mini-swe-agent",
         mswea("benchmarks/swebench.yaml", "observation_template", output=observation(OUT)), (OUT,), ("<output>",)),
    Case("benchmarks/programbench.yaml: output and step-limit notes", "mini-swe-agent",
         mswea("benchmarks/programbench.yaml", "observation_template", output=observation(OUT), **PROGRAMBENCH),
         (OUT,), ("<IMPORTANT>", "steps away from reaching your limit", "running low on time")),
    Case("1.x timeout", "mini-swe-agent-timeout",
         lambda: jinja(MSWEA_V1_TIMEOUT, action={"action": "pytest -x"}, output=OUT), (OUT,),
         ("<command>pytest -x</command> timed out and has been killed", "<output>", "Please try another command")),
    Case("1.x timeout, long output", "mini-swe-agent-timeout",
         lambda: jinja(MSWEA_V1_TIMEOUT, action={"action": "pip install x\npytest"}, output=LONG),
         (LONG[:5000], LONG[-5000:]),
         ("<warning>Output was too long and has been truncated.</warning>", "<output_head>",
          f"<elided_chars>{len(LONG) - 10000} characters elided</elided_chars>", "<output_tail>", "Please try")),
    Case("1.0 timeout", "mini-swe-agent-timeout",
         lambda: jinja(MSWEA_V1_0_TIMEOUT, action={"action": "make"}, output=OUT), (OUT,), (" <output>\n",)),
    Case("mini textbased: format error", "mini-swe-agent-format-error",
         mswea("mini_textbased.yaml", "format_error_template", finish_reason="stop", **FORMAT),
         ("Expected exactly 1 action, found 0.",), ("Format error:", "<error>", "EXACTLY ONE action")),
    Case("mini textbased: output token limit", "mini-swe-agent-format-error",
         mswea("mini_textbased.yaml", "format_error_template", finish_reason="length", **FORMAT), (),
         ("reached the output token limit (finish_reason=length)",)),
    Case("default.yaml: format error", "mini-swe-agent-format-error",
         mswea("default.yaml", "format_error_template", finish_reason="stop", **FORMAT),
         ("Expected exactly 1 action, found 0.",), ("TRIPLEBACKTICKSBASH",)),
    Case("benchmarks/swebench_xml.yaml: format error", "mini-swe-agent-format-error",
         mswea("benchmarks/swebench_xml.yaml", "format_error_template", finish_reason="stop", **FORMAT),
         ("Expected exactly 1 action, found 0.",), ("`<mswea_bash_command>` block",)),
    Case("mini.yaml: tool call error", "mini-swe-agent-format-error",
         mswea("mini.yaml", "format_error_template", finish_reason="stop", has_tool_calls=False, **FORMAT),
         ("Expected exactly 1 action, found 0.",), ("Tool call error:", "submit correct toolcalls")),
    Case("textbased model's default format error", "mini-swe-agent-format-error",
         lambda: jinja(MSWEA_FORMAT_DEFAULT, actions=["ls", "pwd"]), (), ("found 2 actions",)),
]

# --- SWE-agent ---------------------------------------------------------------------------------------------------
# config/default.yaml, default_backticks.yaml and the other 1.x configs: next_step_template and its no-output form.
SWEA_NEXT = "OBSERVATION:\n{{observation}}"
SWEA_NO_OUTPUT = "Your command ran successfully and did not produce any output."
SWEA_NO_OUTPUT_REVIEW = "Your last command ran successfully and did not produce any output."  # benchmarks/2505*.yaml
# config/sweagent_0_7/07.yaml (and exotic/windowed_replace.yaml, coding_challenge.yaml).
SWEA_07_NEXT = "{{observation}}\n(Open file: {{open_file}})\n(Current directory: {{working_dir}})\nbash-$"
SWEA_07_NO_OUTPUT = ("Your command ran successfully and did not produce any output.\n(Open file: {{open_file}})\n"
                     "(Current directory: {{working_dir}})\nbash-$")
# config/bash_only.yaml: next_step_template, next_step_no_output_template, the truncated form and the timeout.
SWEA_BASH_NEXT = "<observation>\n{{observation}}\n</observation>"
SWEA_BASH_NO_OUTPUT = "<warning>\nYour last command ran successfully and did not produce any output.\n</warning>"
SWEA_BASH_TRUNCATED = (
    "<warning>\nThe output of your last command was too long.\nPlease try a different command that produces less "
    "output.\nIf you're looking at a file you can try use head, tail or sed to view a smaller number of lines "
    "selectively.\nIf you're using grep or find and it produced too much output, you can use a more selective search "
    "pattern.\nIf you really need to see something from the full command's output, you can redirect output to a file "
    "and then search in that file.\n</warning>\n\n<observation_head>\n{{observation[ : max_observation_length // 2]}}"
    "\n</observation_head>\n\n<elided_chars>\n{{elided_chars}} characters elided\n</elided_chars>\n\n"
    "<observation_tail>\n{{observation[- max_observation_length // 2:]}}\n</observation_tail>"
)
SWEA_BASH_TIMEOUT = ("<warning>\nThe command '{{command}}' was cancelled because it took more than {{timeout}} seconds "
                     "to complete.\nIt may have been waiting for user input or otherwise blocked.\nPlease try a "
                     "different command.\n</warning>")
# sweagent/agent/agents.py, TemplateConfig's defaults: truncated observation, timeout, shell syntax check.
SWEA_TRUNCATED = (
    "Observation: {{observation[:max_observation_length]}}<response clipped>"
    "<NOTE>Observations should not exceeded {{max_observation_length}} characters. "
    "{{elided_chars}} characters were elided. Please try a different command that produces less output "
    "or use head/tail/grep/redirect the output to a file. Do not use interactive pagers.</NOTE>"
)
SWEA_TIMEOUT = (
    "The command '{{command}}' was cancelled because it took more than {{timeout}} seconds. "
    "Please try a different command that completes more quickly. "
    "Note: A common source of this error is if the command is interactive or requires user input "
    "(it is impossible to receive user input in the current environment, so the command will never complete)."
)
SWEA_SHELL_CHECK = (
    "Your bash command contained syntax errors and was NOT executed. "
    "Please fix the syntax errors and try again. This can be the result "
    "of not adhering to the syntax for multi-line commands. Here is the output of `bash -n`:\n"
    "{{bash_stdout}}\n{{bash_stderr}}"
)
# sweagent/tools/parsing.py: ThoughtActionParser.error_message (start), FunctionCallingParser ("missing"),
# SingleBashCodeBlockParser; sweagent/tools/tools.py: blocklist_error_template.
SWEA_FORMAT_THOUGHT = (
    "Your output was not formatted correctly. You must always include one discussion and one command as part of your "
    "response. Make sure you do not have multiple discussion/command tags.\nPlease make sure your output precisely "
    "matches the following format:\nDISCUSSION\nDiscuss here with yourself about what your planning and what you're "
    "going to do in this step.\n\n```\ncommand(s) that you're going to run\n```\n")
SWEA_FORMAT_FCALL = ("Your last output did not use any tool calls!\nPlease make sure your output includes exactly "
                     "_ONE_ function call!\nYou must invoke the function directly using the function call format.")
SWEA_FORMAT_BASH = ("We did not detect the right number of bash code blocks in your output.\nYou need to include "
                    "EXACTLY ONE bash code block in your output.\n\nFormat your response as:\n\nTHOUGHT: ...")
SWEA_BLOCKLIST = "Operation '{{action}}' is not supported by this environment."
LIMIT = 10_000

SWEA_CASES = [
    Case("next_step_template", "swe-agent-observation", lambda: jinja(SWEA_NEXT, observation=OUT), (OUT,),
         ("OBSERVATION:\n",)),
    Case("next_step_no_output_template", "swe-agent-observation", lambda: SWEA_NO_OUTPUT, (), (SWEA_NO_OUTPUT,)),
    Case("next_step_no_output_template (review configs)", "swe-agent-observation", lambda: SWEA_NO_OUTPUT_REVIEW, (),
         (SWEA_NO_OUTPUT_REVIEW,)),
    Case("0.7 next_step_template", "swe-agent",
         lambda: jinja(SWEA_07_NEXT, observation=OUT, open_file="/repo/a.py", working_dir="/repo"), (OUT,),
         ("(Open file: /repo/a.py)", "(Current directory: /repo)", "bash-$")),
    Case("0.7 next_step_no_output_template", "swe-agent",
         lambda: jinja(SWEA_07_NO_OUTPUT, open_file="n/a", working_dir="/repo"), (), ("did not produce any output",)),
    Case("bash_only next_step_template", "swe-agent-observation", lambda: jinja(SWEA_BASH_NEXT, observation=OUT),
         (OUT,), ("<observation>", "</observation>")),
    Case("bash_only no output", "swe-agent-observation", lambda: SWEA_BASH_NO_OUTPUT, (), ("<warning>",)),
    Case("bash_only truncated observation", "swe-agent-observation",
         lambda: jinja(SWEA_BASH_TRUNCATED, observation=LONG, max_observation_length=LIMIT,
                       elided_chars=len(LONG) - LIMIT), (LONG[:5000], LONG[-5000:]),
         ("<observation_head>", "</observation_head>", "characters elided", "<observation_tail>", "too long")),
    Case("bash_only timeout", "swe-agent-observation",
         lambda: jinja(SWEA_BASH_TIMEOUT, command="python -i", timeout=30), (), ("was cancelled because",)),
    Case("truncated observation (default)", "swe-agent-observation",
         lambda: jinja(SWEA_TRUNCATED, observation=LONG, max_observation_length=LIMIT, elided_chars=len(LONG) - LIMIT),
         (LONG[:LIMIT],), ("Observation: ", "<response clipped><NOTE>Observations should not exceeded", "</NOTE>")),
    Case("command_cancelled_timeout_template (default)", "swe-agent-observation",
         lambda: jinja(SWEA_TIMEOUT, command="sleep 999", timeout=30), (), ("'sleep 999' was cancelled",)),
    Case("shell_check_error_template", "swe-agent-observation",
         lambda: jinja(SWEA_SHELL_CHECK, bash_stdout="", bash_stderr="bash: line 3: syntax error near `fi'"),
         ("\nbash: line 3: syntax error near `fi'",), ("Here is the output of `bash -n`:",)),
    Case("format error: thought_action", "swe-agent-format-error", lambda: SWEA_FORMAT_THOUGHT, (),
         ("Your output was not formatted correctly.",)),
    Case("format error: function_calling, missing", "swe-agent-format-error", lambda: SWEA_FORMAT_FCALL, (),
         ("did not use any tool calls!",)),
    Case("format error: single_bash_code_block", "swe-agent-format-error", lambda: SWEA_FORMAT_BASH, (),
         ("EXACTLY ONE bash code block",)),
    Case("blocklist_error_template", "swe-agent-format-error", lambda: jinja(SWEA_BLOCKLIST, action="vim"), (),
         ("Operation 'vim' is not supported",)),
]

# --- OpenHands CodeAct without function calling ---------------------------------------------------------------------
# openhands/llm/fn_call_converter.py: a tool result becomes a user message f'EXECUTION RESULT of [{tool_name}]:\n'
# + content; openhands/events/observation/commands.py CmdOutputObservation.to_agent_observation() appends the
# metadata lines; runtime/utils/bash.py the timeouts' suffix and continue_prefix (TIMEOUT_MESSAGE_TEMPLATE from
# runtime/utils/bash_constants.py); events/serialization/event.py truncate_content; memory/conversation_memory.py
# the error and the rejection; the "OBSERVATION:\n" prefix of CodeAct before function calling.
OH_WAIT = ("You may wait longer to see additional output by sending empty command '', send other commands to interact "
           "with the current process, send keys (\"C-c\", \"C-z\", \"C-d\") to interrupt/kill the previous command "
           "before sending your new command, or use the timeout parameter in execute_bash for future commands.")
OH_TRUNCATED = "\n[... Observation truncated due to length ...]\n"


def oh_result(content: str, tool: str = "execute_bash") -> str:
    return f"EXECUTION RESULT of [{tool}]:\n" + content


def oh_command(output: str, exit_code: int = 0, prefix: str = "", suffix: str = "", workdir: str | None = "/workspace",
               python: str | None = "/usr/bin/python") -> str:
    text = f"{prefix}{output}{suffix}"
    if workdir:
        text += f"\n[Current working directory: {workdir}]"
    if python:
        text += f"\n[Python interpreter: {python}]"
    if exit_code != -1:
        text += f"\n[Command finished with exit code {exit_code}]"
    return text


def oh_truncate(content: str, max_chars: int) -> str:
    half = max_chars // 2
    return content[:half] + OH_TRUNCATED + content[-half:]


OH_LONG = oh_command(LONG.rstrip("\n"))
OPENHANDS_CASES = [
    Case("command output", "openhands", lambda: oh_result(oh_command(OUT.rstrip("\n"))), (OUT,),
         ("EXECUTION RESULT of [execute_bash]:", "[Current working directory: /workspace]",
          "[Command finished with exit code 0]")),
    Case("command without output", "openhands", lambda: oh_result(oh_command("", 1)), (),
         ("[Command finished with exit code 1]",)),
    Case("no new output (soft timeout)", "openhands", lambda: oh_result(oh_command(
        OUT.rstrip("\n"), -1, "[Below is the output of the previous command.]\n",
        f"\n[The command has no new output after 30 seconds. {OH_WAIT}]", None, None)), (OUT,),
        ("[Below is the output of the previous command.]", "[The command has no new output after 30 seconds.")),
    Case("hard timeout", "openhands", lambda: oh_result(oh_command(
        OUT.rstrip("\n"), -1, suffix=f"\n[The command timed out after 120.0 seconds. {OH_WAIT}]", workdir=None,
        python=None)), (OUT,), ("[The command timed out after 120.0 seconds.",)),
    Case("truncated output", "openhands", lambda: oh_result(oh_truncate(OH_LONG, 10_000)),
         (OH_LONG[:5000], LONG.rstrip("\n")[-(5000 - len(OH_LONG) + len(LONG.rstrip("\n"))):]),
         ("[... Observation truncated due to length ...]", "[Command finished with exit code 0]")),
    Case("editor result", "openhands", lambda: oh_result(OUT, "str_replace_editor"), (OUT,),
         ("EXECUTION RESULT of [str_replace_editor]:",)),
    Case("error observation of a call", "openhands",
         lambda: oh_result("Invalid path: /nope.\n[Error occurred in processing last action]", "str_replace_editor"),
         ("Invalid path: /nope.",), ("[Error occurred in processing last action]",)),
    Case("error observation", "openhands",
         lambda: "Agent stuck in a loop.\n[Error occurred in processing last action]", ("Agent stuck in a loop.",),
         ("[Error occurred in processing last action]",)),
    Case("CodeAct OBSERVATION:", "swe-agent-observation", lambda: "OBSERVATION:\n" + OUT, (OUT,), ("OBSERVATION:",)),
    Case("rejected by the user", "swe-agent-observation",
         lambda: "OBSERVATION:\nAction has been rejected by the user! Waiting for further user input.\n"
                 "[Last action has been rejected by the user]",
         ("Action has been rejected by the user! Waiting for further user input.",),
         ("[Last action has been rejected by the user]",)),
]

# --- Cline and Roo Code --------------------------------------------------------------------------------------------
# Cline src/core/task (ClaudeDev.ts in early releases): each tool's result follows a "[tool for 'x'] Result:" block;
# src/core/prompts/responses.ts: toolError, toolDenied, toolDeniedWithFeedback, noToolsUsed; the command tool's
# "Command executed.\nOutput:\n" (Roo Code src/core/tools/ExecuteCommandTool.ts: "Command executed in terminal
# within working directory '…'. Exit code: 0\nOutput:\n"). Blocks joined by newlines, as a string content.
CLINE_NO_TOOL = ("[ERROR] You did not use a tool in your previous response! Please retry with a tool use.\n\n"
                 "# Reminder: Instructions for Tool Use\n\nTool uses are formatted using XML-style tags.")
CLINE_CASES = [
    Case("execute_command", "cline",
         lambda: f"[execute_command for 'npm test'] Result:\nCommand executed.\nOutput:\n{OUT}", (OUT,),
         ("[execute_command for 'npm test'] Result:", "Command executed.\nOutput:\n")),
    Case("execute_command without output", "cline",
         lambda: "[execute_command for 'touch a'] Result:\nCommand executed.", (), ("Command executed.",)),
    Case("execute_command still running", "cline",
         lambda: f"[execute_command for 'npm start'] Result:\nCommand is still running in the user's terminal.\n"
                 f"Here's the output so far:\n{OUT}", (OUT,), ("Command is still running", "output so far:")),
    Case("Roo Code execute_command", "cline",
         lambda: f"[execute_command for 'ls'] Result:\nCommand executed in terminal within working directory "
                 f"'/repo'. Exit code: 0\nOutput:\n{OUT}", (OUT,), ("within working directory '/repo'. Exit code: 0",)),
    Case("read_file and a tool error", "cline",
         lambda: f"[read_file for 'a.py'] Result:\n{OUT}\n[read_file for 'b.py'] Result:\nThe tool execution failed "
                 "with the following error:\n<error>\nError reading file: ENOENT\n</error>",
         (OUT, "Error reading file: ENOENT"), ("[read_file for 'b.py'] Result:", "failed with the following error",
                                               "<error>", "</error>")),
    Case("toolDenied", "cline", lambda: "[write_to_file for 'a.py'] Result:\nThe user denied this operation.", (),
         ("The user denied this operation.",)),
    Case("toolDeniedWithFeedback", "cline",
         lambda: "[write_to_file for 'a.py'] Result:\nThe user denied this operation and provided the following "
                 "feedback:\n<feedback>\nuse tabs\n</feedback>", ("use tabs",), ("<feedback>", "</feedback>")),
    Case("noToolsUsed", "cline-no-tool", lambda: CLINE_NO_TOOL, (), ("You did not use a tool",)),
]

CASES = MSWEA_CASES + SWEA_CASES + OPENHANDS_CASES + CLINE_CASES


@pytest.mark.parametrize("case", CASES, ids=[f"{c.preset}: {c.name}" for c in CASES])
def test_a_shipped_template_is_recognised_and_only_its_results_are_cut(case: Case) -> None:
    text = case.render()
    history = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "```bash\nls\n```"},
               {"role": "user", "content": text}]
    found = find_results(history)
    assert [r.preset for r in found] == [case.preset], text[:300]
    segments = found[0].segments
    bodies = tuple(text[s.start:s.end].strip("\n") for s in segments if s.end > s.start)
    assert bodies == tuple(b.strip("\n") for b in case.bodies)
    cut = compose(text, segments, {k: "✂" for k, s in enumerate(segments) if s.end > s.start})
    assert wrapper_intact(text, cut, segments)
    for words in case.words:
        assert words in cut, words


def test_cline_sends_its_blocks_as_text_parts_and_they_are_recognised_and_cut_too() -> None:
    """Over an OpenAI-compatible API, Cline and Roo Code send a results message as a list of text parts (their
    api/transform/openai-format.ts): the "[tool] Result:" line, the output, the environment details."""
    from ctxproxy.config import load_settings
    from ctxproxy.proxy.core import Rules, message_hash, violations
    from ctxproxy.proxy.core.fenced import builtin_presets, route_of
    from ctxproxy.proxy.core.project import project
    from ctxproxy.proxy.core.tokens import MessageCounter
    from ctxproxy.proxy.engine.budgets import budget_for

    parts = [{"type": "text", "text": "[execute_command for 'pytest'] Result:"},
             {"type": "text", "text": f"Command executed.\nOutput:\n{LONG}"},
             {"type": "text", "text": "<environment_details>\n# Current Working Directory\n/repo\n"
                                      "</environment_details>"}]
    history = [{"role": "user", "content": [{"type": "text", "text": "<task>\nfix it\n</task>"}]},
               {"role": "assistant", "content": "<execute_command>\n<command>pytest</command>\n</execute_command>"},
               {"role": "user", "content": parts}]
    assert [r.preset for r in find_results(history)] == ["cline"]
    assert route_of(history, None, "auto") == "fenced"
    rules = Rules(budget_for(load_settings(env={}), 8192), fenced=builtin_presets())
    p = project(history, [message_hash(m) for m in history], [], rules, MessageCounter(), seen=0)
    out = p.messages[-1]["content"]
    assert isinstance(out, str) and out.startswith("[execute_command for 'pytest'] Result:\nCommand executed.\n"
                                                   "Output:\n[overflow id=")
    assert len(out) < len(LONG) // 2
    assert violations(history, p.messages, fenced={i: r.segments for i, r in p.state.fenced.items()}) == []
