"""The agent's tools: JSON schemas for the prompt and their execution in a sandbox.

A tool never raises on bad arguments from the model: it returns an observation that says what was wrong, so
the episode goes on (the model sees its mistake, the rollout is not lost).
"""

from __future__ import annotations

from dataclasses import dataclass

from environments.sandbox import Sandbox
from environments.types import ExecResult, Task, ToolCall

EDIT_COMMANDS = ("view", "create", "str_replace", "insert")
# What each editor command needs besides `command` and `path`; the others it may not take.
EDIT_ARGUMENTS = {"view": ((), ("view_range",)), "create": (("file_text",), ()),
                  "str_replace": (("old_str",), ("new_str",)), "insert": (("insert_line", "new_str"), ())}
SNIPPET_LINES = 4  # lines of context shown around an edit

TOOL_SPECS: list[dict] = [
    {"name": "bash", "description": "Run a shell command in /workspace.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
    {"name": "write_file", "description": "Create or overwrite a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "edit_file",
     "description": "File editor. view [view_range]; create file_text; str_replace a unique old_str by "
                    "new_str; insert new_str after line insert_line (0: top).",
     "parameters": {"type": "object", "properties": {
         "command": {"type": "string", "enum": list(EDIT_COMMANDS)},
         "path": {"type": "string"},
         "file_text": {"type": "string"},
         "old_str": {"type": "string"},
         "new_str": {"type": "string"},
         "insert_line": {"type": "integer"},
         "view_range": {"type": "array", "items": {"type": "integer"}}},
         "required": ["command", "path"]}},
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
    """Keep the head and the tail of a long output, with a note of what was cut (docs/ALGORITHMS.md S10)."""
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
        problem = _type_problem(props[key], value)
        if problem:
            return f"{call.name}: argument {key!r} {problem}"
    return None


def _type_problem(prop: dict, value) -> str | None:
    kind = prop["type"]
    if kind == "string" and not isinstance(value, str):
        return "must be a string"
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if kind == "array":
        if not isinstance(value, list):
            return "must be a list"
        item_type = prop.get("items", {}).get("type")
        if item_type and any(_type_problem({"type": item_type}, item) for item in value):
            return f"must be a list of {item_type}s"
    if "enum" in prop and value not in prop["enum"]:
        return f"must be one of {', '.join(map(str, prop['enum']))}"
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
    if call.name == "edit_file":
        return edit_file(call.arguments, sandbox, timeout, max_chars)
    if call.name == "run_tests":
        if not task.visible_tests:
            return Observation("This task has no visible tests.", exit_code=5)
        result = sandbox.exec(test_command(task), timeout=timeout)
        return Observation(format_exec(result, max_chars), result.exit_code)
    raise AssertionError(call.name)  # validate_arguments covers every name


# ---- the file editor -----------------------------------------------------------------------------------------
class EditError(ValueError):
    """An editor call that cannot apply (text not found, line out of range): the model's mistake to see."""


def edit_arguments_problem(args: dict) -> str | None:
    """What is wrong with an editor call's arguments for its command (beyond the schema), or None."""
    command = args.get("command")
    needed, optional = EDIT_ARGUMENTS[command]
    missing = [k for k in needed if k not in args]
    if missing:
        return f"edit_file {command}: missing argument(s) {', '.join(missing)}"
    extra = sorted(set(args) - {"command", "path", *needed, *optional})
    if extra:
        return f"edit_file {command}: does not take {', '.join(extra)}"
    if not args["path"].strip():
        return "edit_file: empty path"
    if command == "str_replace" and not args["old_str"]:
        return "edit_file str_replace: old_str is empty"
    if command == "view" and "view_range" in args and len(args["view_range"]) != 2:
        return "edit_file view: view_range must be [first, last]"
    return None


def apply_edit(content: str, args: dict) -> str:
    """The file's text after a str_replace or insert (the guard computes the same to judge the result)."""
    command = args["command"]
    if command == "str_replace":
        old, new = args["old_str"], args.get("new_str", "")
        count = content.count(old)
        if count == 0:
            raise EditError("old_str does not occur in the file; nothing was replaced (it must match exactly, "
                            "whitespace included)")
        if count > 1:
            lines = [content.count("\n", 0, i) + 1 for i in _occurrences(content, old)]
            raise EditError(f"old_str occurs {count} times (lines {', '.join(map(str, lines[:10]))}); include "
                            "more context so that it is unique")
        return content.replace(old, new, 1)
    if command == "insert":
        lines = content.splitlines(keepends=True)
        at, text = args["insert_line"], args["new_str"]
        if not 0 <= at <= len(lines):
            raise EditError(f"insert_line {at} is outside the file: it has {len(lines)} lines (0 inserts at the top)")
        before = "".join(lines[:at])
        if before and not before.endswith("\n"):
            before += "\n"
        if lines[at:] and not text.endswith("\n"):
            text += "\n"
        return before + text + "".join(lines[at:])
    raise ValueError(f"apply_edit: {command!r} is not an edit")


def _occurrences(text: str, part: str):
    i = text.find(part)
    while i >= 0:
        yield i
        i = text.find(part, i + 1)


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{first + i:6d}\t{line}" for i, line in enumerate(lines))


def _snippet(content: str, start_line: int, n_lines: int) -> str:
    """Lines around an edit (1-based start, the edit's length in lines), numbered."""
    lines = content.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        return "(empty file)"
    first = max(min(start_line, len(lines)) - SNIPPET_LINES, 1)
    last = min(start_line + n_lines - 1 + SNIPPET_LINES, len(lines))
    return _numbered(lines[first - 1:last], first)


def _read_for_edit(sandbox: Sandbox, path: str, timeout: float | None) -> str:
    result = sandbox.exec(["/bin/sh", "-c", 'if [ -d "$1" ]; then echo "is a directory" >&2; exit 21; fi; '
                           'exec cat -- "$1"', "sh", path], timeout=timeout)
    if result.exit_code != 0:
        raise EditError(result.stderr.strip().removeprefix("cat: ") or f"cannot read {path}")
    if result.truncated:
        raise EditError(f"{path} is too large for the editor; use bash (sed, python) on it")
    if "\ufffd" in result.stdout:
        raise EditError(f"{path} is not UTF-8 text; the editor leaves it alone")
    return result.stdout


def edit_file(args: dict, sandbox: Sandbox, timeout: float | None = None, max_chars: int = 4000) -> Observation:
    """The `edit_file` tool: every read and write goes through the sandbox (never the host path)."""
    problem = edit_arguments_problem(args)
    if problem:
        return Observation(f"Error: {problem}", exit_code=2, error=True)
    command, path = args["command"], args["path"].strip()
    try:
        if command == "view":
            return _view(sandbox, path, args.get("view_range"), timeout, max_chars)
        if command == "create":
            sandbox.write_file(path, args["file_text"])
            return Observation(f"Wrote {len(args['file_text'].encode())} bytes to {path}.")
        content = _read_for_edit(sandbox, path, timeout)
        new = apply_edit(content, args)
        sandbox.write_file(path, new)
    except EditError as exc:
        return Observation(f"Error: edit_file {command} {path}: {exc}", exit_code=1)
    except OSError as exc:
        return Observation(f"Error: {exc}", exit_code=1)
    if command == "str_replace":
        start = content[:content.index(args["old_str"])].count("\n") + 1
        shown = _snippet(new, start, args.get("new_str", "").count("\n") + 1)
    else:
        start = args["insert_line"] + 1
        shown = _snippet(new, start, args["new_str"].count("\n") + (0 if args["new_str"].endswith("\n") else 1))
    return Observation(truncate_middle(f"Edited {path}. Lines around the change:\n{shown}", max_chars))


def _view(sandbox: Sandbox, path: str, view_range, timeout, max_chars) -> Observation:
    listing = sandbox.exec(["/bin/sh", "-c", 'if [ -d "$1" ]; then find "$1" -maxdepth 2 -not -path "*/.*" '
                            '-not -name __pycache__ | sort; else exit 3; fi', "sh", path], timeout=timeout)
    if listing.exit_code == 0:
        if view_range is not None:
            return Observation(f"Error: edit_file view: {path} is a folder; view_range is for files", 2, error=True)
        return Observation(truncate_middle(f"Files in {path} (two levels):\n{listing.stdout.rstrip()}", max_chars))
    try:
        content = _read_for_edit(sandbox, path, timeout)
    except EditError as exc:
        return Observation(f"Error: edit_file view {path}: {exc}", exit_code=1)
    lines = content.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first, last = 1, len(lines)
    if view_range is not None:
        first, last = view_range
        last = len(lines) if last == -1 else last
        if not 1 <= first <= max(len(lines), 1) or last < first or last > len(lines):
            return Observation(f"Error: edit_file view: view_range {view_range} is outside the file's "
                               f"{len(lines)} lines (first from 1, last up to {len(lines)} or -1)", exit_code=1)
    body = _numbered(lines[first - 1:last], first) if lines else "(empty file)"
    return Observation(truncate_middle(body, max_chars))
