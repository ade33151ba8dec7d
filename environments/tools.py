"""The agent's tools: JSON schemas for the prompt and their execution in a sandbox.

A tool never raises on bad arguments from the model: it returns an observation that says what was wrong, so
the episode goes on (the model sees its mistake, the rollout is not lost).
"""

from __future__ import annotations

from dataclasses import dataclass

from environments.sandbox import Sandbox
from environments.types import ExecResult, Task, ToolCall

TOOL_SPECS: list[dict] = [
    {"name": "bash", "description": "Run a shell command in /workspace.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "write_file", "description": "Create or overwrite a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "run_tests", "description": "Run the visible tests.",
     "parameters": {"type": "object", "properties": {}, "required": []}},
    {"name": "submit", "description": "Finish; hidden tests grade your files.",
     "parameters": {"type": "object", "properties": {}, "required": []}},
]
TOOL_NAMES = [t["name"] for t in TOOL_SPECS]


@dataclass
class Observation:
    text: str
    exit_code: int = 0
    submitted: bool = False
    error: bool = False  # the call itself was invalid (unknown tool, bad arguments)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of a long output, with a note of what was cut (ALGORITHMS.md S10)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters truncated ...]\n{text[-half:]}"


def format_exec(result: ExecResult, max_chars: int) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append(result.stderr.rstrip("\n"))
    body = "\n".join(parts)
    status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
    return truncate_middle(f"{body}\n[{status}]" if body else f"[{status}]", max_chars)


def validate_arguments(call: ToolCall) -> str | None:
    spec = next((t for t in TOOL_SPECS if t["name"] == call.name), None)
    if spec is None:
        return f"unknown tool {call.name!r}; available tools: {', '.join(TOOL_NAMES)}"
    if not isinstance(call.arguments, dict):
        return f"{call.name}: arguments must be a JSON object"
    props = spec["parameters"]["properties"]
    missing = [k for k in spec["parameters"]["required"] if k not in call.arguments]
    if missing:
        return f"{call.name}: missing argument(s) {', '.join(missing)}"
    for key, value in call.arguments.items():
        if key not in props:
            return f"{call.name}: unexpected argument {key!r}"
        if props[key]["type"] == "string" and not isinstance(value, str):
            return f"{call.name}: argument {key!r} must be a string"
    return None


def test_command(task: Task) -> list[str]:
    return ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-x", "--tb=short",
            *[f.path for f in task.visible_tests]]


def execute_tool(call: ToolCall, sandbox: Sandbox, task: Task, timeout: float | None = None,
                 max_chars: int = 4000) -> Observation:
    problem = validate_arguments(call)
    if problem:
        return Observation(f"Error: {problem}", exit_code=2, error=True)
    if call.name == "submit":
        return Observation("Submitted.", submitted=True)
    if call.name == "bash":
        result = sandbox.exec(call.arguments["command"], timeout=timeout)
        return Observation(format_exec(result, max_chars), result.exit_code)
    if call.name == "write_file":
        path, content = call.arguments["path"].strip(), call.arguments["content"]
        if not path:
            return Observation("Error: write_file: empty path", exit_code=2, error=True)
        try:
            sandbox.write_file(path, content)
        except OSError as exc:
            return Observation(f"Error: {exc}", exit_code=1)
        return Observation(f"Wrote {len(content.encode())} bytes to {path}.")
    if call.name == "run_tests":
        if not task.visible_tests:
            return Observation("This task has no visible tests.", exit_code=5)
        result = sandbox.exec(test_command(task), timeout=timeout)
        return Observation(format_exec(result, max_chars), result.exit_code)
    raise AssertionError(call.name)  # validate_arguments covers every name
