"""The JSON tool-call format shared by the tool environments, and how a command's result is shown.

The model writes ``<tool_call>{"name": TOOL, "arguments": {ARG: ...}}</tool_call>`` (the chat template's
rendering of structured tool calls; the OpenAI form ``{"type": "function", "function": {...}}`` and
arguments given as a JSON string are accepted too).
"""

from __future__ import annotations

import json
import re

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
