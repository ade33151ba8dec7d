"""Tool-call formats, pluggable per model family.

`json`: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes/Qwen style; the default policy's).
`glm`:  <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n…</tool_call> (GLM-4.5 / GLM-5).

Parsing never raises: a malformed call becomes an error string that the agent loop turns into an error
observation, so the model sees what was wrong and the episode continues.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from environments.types import ToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""  # text outside tool calls


def last_python_block(text: str) -> str | None:
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def _tool_list(tools: list[dict]) -> str:
    lines = []
    for t in tools:
        props = t["parameters"].get("properties", {})
        args = ", ".join(props)
        lines.append(f"- {t['name']}({args}): {t['description']}")
    return "\n".join(lines)


class ToolCallParser:
    name = "base"

    def __init__(self, tools: list[dict]):
        self.tools = {t["name"]: t for t in tools}

    def parse(self, text: str) -> ParsedTurn:
        raise NotImplementedError

    def format_call(self, call: ToolCall) -> str:
        raise NotImplementedError

    def instructions(self) -> str:
        raise NotImplementedError


class JSONToolParser(ToolCallParser):
    name = "json"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content=_BLOCK.sub("", text).strip())
        for i, body in enumerate(_BLOCK.findall(text), 1):
            body = body.strip()
            try:
                payload = json.loads(body)
            except json.JSONDecodeError as exc:
                turn.errors.append(f"tool call {i}: invalid JSON ({exc.msg} at position {exc.pos})")
                continue
            for item in payload if isinstance(payload, list) else [payload]:
                call, error = self._to_call(item)
                if error:
                    turn.errors.append(f"tool call {i}: {error}")
                else:
                    turn.calls.append(call)
        return turn

    @staticmethod
    def _to_call(item) -> tuple[ToolCall | None, str | None]:
        if not isinstance(item, dict):
            return None, 'expected an object {"name": ..., "arguments": {...}}'
        name = item.get("name")
        if not isinstance(name, str) or not name:
            return None, 'missing "name"'
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # OpenAI style: arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None, '"arguments" is a string that is not valid JSON'
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return None, '"arguments" must be an object'
        return ToolCall(name, args), None

    def format_call(self, call: ToolCall) -> str:
        return "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}) + "</tool_call>"

    def instructions(self) -> str:
        return ("You act by calling tools. To call a tool, write:\n"
                '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
                "Available tools:\n" + _tool_list(list(self.tools.values())))


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GLMToolParser(ToolCallParser):
    name = "glm"

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content=_BLOCK.sub("", text).strip())
        for i, body in enumerate(_BLOCK.findall(text), 1):
            head, _, _ = body.partition("<arg_key>")
            name = head.strip()
            if not name or "\n" in name or " " in name:
                turn.errors.append(f"tool call {i}: the tool name must come first, alone on its line")
                continue
            args, error = {}, None
            for key, raw in _ARG.findall(body):
                key = key.strip()
                args[key] = self._value(name, key, raw)
            if body.count("<arg_key>") != len(args):
                error = "every <arg_key> needs a matching <arg_value>"
            if error:
                turn.errors.append(f"tool call {i}: {error}")
            else:
                turn.calls.append(ToolCall(name, args))
        return turn

    def _value(self, tool: str, key: str, raw: str):
        """String arguments are taken verbatim; others are JSON (GLM's template writes them with tojson)."""
        declared = self.tools.get(tool, {}).get("parameters", {}).get("properties", {}).get(key, {}).get("type")
        if declared in (None, "string"):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def format_call(self, call: ToolCall) -> str:
        parts = [f"<tool_call>{call.name}\n"]
        for k, v in call.arguments.items():
            value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            parts.append(f"<arg_key>{k}</arg_key>\n<arg_value>{value}</arg_value>\n")
        return "".join(parts) + "</tool_call>"

    def instructions(self) -> str:
        return ("Call a tool by writing <tool_call>TOOL_NAME\n<arg_key>ARGUMENT</arg_key>\n"
                "<arg_value>VALUE</arg_value>\n</tool_call>\nTools:\n" + _tool_list(list(self.tools.values())))


TOOL_PARSERS = {p.name: p for p in (JSONToolParser, GLMToolParser)}


def make_tool_parser(name: str, tools: list[dict]) -> ToolCallParser:
    try:
        return TOOL_PARSERS[name](tools)
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(TOOL_PARSERS)}") from None
