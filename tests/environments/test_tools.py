"""The agent's tools on real sandboxes (each backend): bash's timeout and truncation, the file editor."""

import pytest

from environments import TOOL_SPECS, Task, TaskFile, ToolCall, execute_tool
from environments.tools import apply_edit, validate_arguments

TASK = Task("t", "s", [TaskFile("solution.py", "def f():\n    return 1\n")])


def call(box, name, max_chars=4000, timeout=None, **arguments):
    return execute_tool(ToolCall(name, arguments), box, TASK, timeout=timeout, max_chars=max_chars)


def test_bash_timeout_and_head_tail_truncation(make):
    box = make()
    obs = call(box, "bash", max_chars=400, command="seq 1 100000")
    assert obs.exit_code == 0 and len(obs.text) < 500
    head, tail = obs.text.split("characters truncated ...]")
    assert head.startswith("1\n2\n3\n") and "[... " in head and tail.rstrip().endswith("100000\n[exit code 0]")
    obs = call(box, "bash", timeout=5, command="echo started; sleep 20")  # 5 s: the sandbox's start is in it
    assert obs.exit_code == 124 and obs.text == "started\n[timed out]"
    assert call(box, "bash", command="exit 7").text == "[exit code 7]"


def test_file_editor(make):
    box = make()
    box.write_file("solution.py", "def f():\n    return 1\n")
    assert call(box, "edit_file", command="view", path="solution.py").text == "     1\tdef f():\n     2\t    return 1"
    assert "solution.py" in call(box, "edit_file", command="view", path=".").text
    obs = call(box, "edit_file", command="str_replace", path="solution.py", old_str="return 1", new_str="return 2")
    assert obs.exit_code == 0 and "     2\t    return 2" in obs.text
    obs = call(box, "edit_file", command="insert", path="solution.py", insert_line=0, new_str="import os")
    assert obs.exit_code == 0 and box.read_file("solution.py") == "import os\ndef f():\n    return 2\n"
    obs = call(box, "edit_file", command="create", path="pkg/new.py", file_text="a = 1\na = 1\n")
    assert obs.exit_code == 0 and (box.workspace / "pkg" / "new.py").read_text() == "a = 1\na = 1\n"
    # Mistakes come back as observations; the file is left as it was.
    for args, message in [
        ({"command": "str_replace", "path": "pkg/new.py", "old_str": "a = 1", "new_str": "b"},
         "occurs 2 times (lines 1, 2)"),
        ({"command": "str_replace", "path": "pkg/new.py", "old_str": "zzz", "new_str": "b"}, "does not occur"),
        ({"command": "insert", "path": "pkg/new.py", "insert_line": 9, "new_str": "b"}, "outside the file"),
        ({"command": "view", "path": "pkg/new.py", "view_range": [2, 5]}, "outside the file"),
        ({"command": "view", "path": "missing.py"}, "No such file"),
        ({"command": "str_replace", "path": "pkg", "old_str": "a"}, "is a directory"),
    ]:
        obs = call(box, "edit_file", **args)
        assert obs.exit_code == 1 and message in obs.text, (args, obs.text)
    assert box.read_file("pkg/new.py") == "a = 1\na = 1\n"
    box.exec("printf '\\377\\376 binary' > blob.bin")
    assert "not UTF-8" in call(box, "edit_file", command="str_replace", path="blob.bin", old_str="b", new_str="c").text
    box.exec("ln -s /usr/bin link")  # edits go through the sandbox: a link out of the workspace does not help
    obs = call(box, "edit_file", command="create", path="link/evil", file_text="x")
    assert obs.exit_code == 1 and "Error" in obs.text


def test_editor_arguments_are_checked():
    for arguments, message in [
        ({"command": "delete", "path": "a"}, "must be one of view, create, str_replace, insert"),
        ({"command": "view"}, "missing argument(s) path"),
        ({"command": "insert", "path": "a", "new_str": "x"}, "missing argument(s) insert_line"),
        ({"command": "insert", "path": "a", "new_str": "x", "insert_line": "3"}, "must be an integer"),
        ({"command": "insert", "path": "a", "new_str": "x", "insert_line": True}, "must be an integer"),
        ({"command": "view", "path": "a", "view_range": [1]}, "view_range must be [first, last]"),
        ({"command": "view", "path": "a", "view_range": ["1", 2]}, "must be a list of integers"),
        ({"command": "create", "path": "a", "file_text": "x", "old_str": "y"}, "does not take old_str"),
        ({"command": "str_replace", "path": "a", "old_str": ""}, "old_str is empty"),
        ({"command": "create", "path": " ", "file_text": ""}, "empty path"),
    ]:
        obs = execute_tool(ToolCall("edit_file", arguments), None, TASK)
        assert obs.error and obs.exit_code == 2 and message in obs.text, (arguments, obs.text)
    assert validate_arguments(ToolCall("edit_file", {"command": "view", "path": "a", "view_range": [1, -1]})) is None


def test_apply_edit_keeps_lines_whole():
    assert apply_edit("a\nb", {"command": "insert", "insert_line": 2, "new_str": "c"}) == "a\nb\nc"
    assert apply_edit("a\nb\n", {"command": "insert", "insert_line": 1, "new_str": "x"}) == "a\nx\nb\n"
    assert apply_edit("", {"command": "insert", "insert_line": 0, "new_str": "x\n"}) == "x\n"
    assert apply_edit("ab ab", {"command": "str_replace", "old_str": "ab a", "new_str": "_"}) == "_b"


@pytest.mark.parametrize("fmt", ["json", "glm"])
def test_parsers_read_editor_calls(fmt):
    from rollout.tool_parsers import make_tool_parser

    parser = make_tool_parser(fmt, TOOL_SPECS)
    original = ToolCall("edit_file", {"command": "insert", "path": "a.py", "insert_line": 3, "new_str": "x = 1\n"})
    parsed = parser.parse(parser.format_call(original))
    assert parsed.errors == [] and parsed.calls[0].arguments == original.arguments
