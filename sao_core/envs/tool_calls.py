"""The JSON tool-call format shared by the tool environments, and how a command's result is shown.

The model writes ``<tool_call>{"name": TOOL, "arguments": {ARG: ...}}</tool_call>`` (the chat template's
rendering of structured tool calls; the OpenAI form ``{"type": "function", "function": {...}}`` and
arguments given as a JSON string are accepted too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from sao_core.sandbox.base import ExecResult

# The body of each tool call in a model turn; an unterminated last call (cut by the token budget) counts.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_call(body: str, tool: str, argument: str, placeholder: str) -> tuple[str | None, str | None]:
    """``(value of arguments[argument], None)`` for a valid call of `tool`, else ``(None, error observation)``."""
    try:
        call = json.loads(body, strict=False)  # strict=False: raw newlines inside strings
    except json.JSONDecodeError as exc:
        return None, f"error: the tool call is not valid JSON ({exc.msg} at position {exc.pos})"
    if not isinstance(call, dict):
        return None, f'error: a tool call must be a JSON object {{"name": "{tool}", "arguments": {{...}}}}'
    if isinstance(call.get("function"), dict):
        call = call["function"]
    name = call.get("name")
    if name != tool:
        return None, f"error: unknown tool {name!r}; the only tool is '{tool}'"
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError as exc:
            return None, f"error: the tool call's arguments are not valid JSON ({exc.msg})"
    value = arguments.get(argument) if isinstance(arguments, dict) else None
    if not isinstance(value, str) or not value.strip():
        return None, f'error: {tool} needs arguments {{"{argument}": "{placeholder}"}}'
    return value, None


def format_exec_output(result: ExecResult, timeout_s: float, max_chars: int, always_status: bool) -> str:
    """Observation text of one command: stdout then stderr (cut in the middle past `max_chars`
    characters), then ``[timed out after T s]`` or ``[exit code N]`` (on success only if `always_status`);
    ``(no output)`` when there is nothing to show."""
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}"
    elif result.truncated:
        text += "\n...[output cut by the sandbox]"
    status = ""
    if result.timed_out:
        status = f"[timed out after {timeout_s:g} s]"
    elif result.exit_code != 0 or always_status:
        status = f"[exit code {result.exit_code}]"
    if status:
        return f"{text.rstrip()}\n{status}" if text.strip() else status
    return text if text.strip() else "(no output)"


@dataclass(frozen=True)
class CommandTool:
    """A tool whose call carries one string argument that the environment runs in its sandbox (a program, a
    shell command): its function spec for the chat template, the parsing of its calls and the text of a run.

    `placeholder` stands for the argument in the error shown for a call without it; `always_status` shows
    ``[exit code 0]`` after a successful run too."""

    name: str
    argument: str
    placeholder: str
    description: str
    argument_description: str
    always_status: bool

    def spec(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function spec (for chat templates that render a `tools` list)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {self.argument: {"type": "string", "description": self.argument_description}},
                    "required": [self.argument],
                },
            },
        }

    def parse(self, body: str) -> tuple[str | None, str | None]:
        """``(argument, None)`` for a valid call body of this tool, else ``(None, error observation)``."""
        return parse_tool_call(body, self.name, self.argument, self.placeholder)

    def observation(self, result: ExecResult, timeout_s: float, max_chars: int) -> str:
        """The observation text of one run (see `format_exec_output`)."""
        return format_exec_output(result, timeout_s, max_chars, always_status=self.always_status)
