import pytest

from environments import TOOL_SPECS, ToolCall
from rollout.tool_parsers import GLMToolParser, JSONToolParser, last_python_block, make_tool_parser


@pytest.fixture
def json_parser():
    return JSONToolParser(TOOL_SPECS)


@pytest.fixture
def glm_parser():
    return GLMToolParser(TOOL_SPECS)


def test_json_valid_calls(json_parser):
    text = ('I will look.\n<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>\n'
            '<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
    turn = json_parser.parse(text)
    assert turn.errors == []
    assert turn.calls == [ToolCall("bash", {"command": "ls -la"}), ToolCall("submit", {})]
    assert turn.content == "I will look."


def test_json_variants(json_parser):
    turn = json_parser.parse('<tool_call>[{"name": "bash", "parameters": {"command": "pwd"}}, '
                             '{"name": "run_tests", "arguments": "{}"}]</tool_call>')
    assert turn.calls == [ToolCall("bash", {"command": "pwd"}), ToolCall("run_tests", {})]
    unclosed = json_parser.parse('<tool_call>{"name": "submit", "arguments": {}}')
    assert unclosed.calls == [ToolCall("submit", {})]


@pytest.mark.parametrize("body,expected", [
    ('{"name": "bash", "arguments": {"command": "ls"', "invalid JSON"),
    ('{"arguments": {}}', 'missing "name"'),
    ('{"name": "bash", "arguments": [1, 2]}', "must be an object"),
    ('{"name": "bash", "arguments": "not json"}', "not valid JSON"),
    ('"just a string"', "expected an object"),
])
def test_json_malformed_reports_not_raises(json_parser, body, expected):
    turn = json_parser.parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == [] and len(turn.errors) == 1 and expected in turn.errors[0]


def test_json_roundtrip(json_parser):
    call = ToolCall("write_file", {"path": "a.py", "content": 'print("x")\n'})
    assert json_parser.parse(json_parser.format_call(call)).calls == [call]


def test_glm_format(glm_parser):
    text = ("<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>src/a.py</arg_value>\n"
            "<arg_key>content</arg_key>\n<arg_value>x = 1\ny = {\"a\": 2}\n</arg_value>\n</tool_call>")
    turn = glm_parser.parse(text)
    assert turn.errors == []
    assert turn.calls == [ToolCall("write_file", {"path": "src/a.py", "content": 'x = 1\ny = {"a": 2}\n'})]


def test_glm_typed_values_and_errors():
    tools = [{"name": "f", "description": "", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}, "required": []}}]
    parser = GLMToolParser(tools)
    turn = parser.parse("<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n"
                        "<arg_key>s</arg_key>\n<arg_value>42</arg_value>\n</tool_call>")
    assert turn.calls == [ToolCall("f", {"n": 42, "s": "42"})]
    bad = parser.parse("<tool_call>f\n<arg_key>n</arg_key>\n</tool_call>")
    assert bad.calls == [] and "matching <arg_value>" in bad.errors[0]
    noname = parser.parse("<tool_call>\n<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>")
    assert noname.calls == [] and noname.errors


def test_glm_roundtrip(glm_parser):
    call = ToolCall("bash", {"command": "python -m pytest -q"})
    assert glm_parser.parse(glm_parser.format_call(call)).calls == [call]


def test_code_block_and_registry():
    assert last_python_block("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert last_python_block("no code") is None
    with pytest.raises(ValueError, match="unknown tool-call format"):
        make_tool_parser("yaml", TOOL_SPECS)
