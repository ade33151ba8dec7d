"""`python -m environments`: list, grade, play (against real sandboxes, with the guard)."""

import io
import json
import subprocess
import sys

import pytest

from environments.__main__ import main, parse_line


def run(capsys, monkeypatch, argv, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    return code, capsys.readouterr().out


def test_list_with_filters(capsys, monkeypatch, shipped_tasks):
    code, out = run(capsys, monkeypatch, ["list", "--split", "heldout", "--domain", "bugfix", "--json"])
    rows = [json.loads(line) for line in out.splitlines()]
    expected = [t.id for t in shipped_tasks.tasks if t.split == "heldout" and t.domain == "bugfix"]
    assert code == 0 and [r["id"] for r in rows] == expected and len(rows) >= 2
    assert all(r["split"] == "heldout" and r["domain"] == "bugfix" and r["hidden_tests"] >= 1 for r in rows)
    code, out = run(capsys, monkeypatch, ["list"])
    assert code == 0 and len(out.splitlines()) == len(shipped_tasks.tasks) + 1 and out.startswith("id")


def test_list_split_all_means_every_split_and_a_bad_record_warns_once(tmp_path, shipped_tasks):
    """`--split all` as in `rl.evaluate --split all`; a malformed record is reported once, by the loader."""
    code = "import sys; from environments.__main__ import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "list", "--split", "all", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == len(shipped_tasks.tasks), proc.stderr
    good = json.dumps({"id": "t1", "statement": "s", "entry_file": "a.py", "files": [{"path": "a.py", "content": ""}],
                       "hidden_tests": [{"path": "test_a.py", "content": "def test_a():\n    pass\n"}]})
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(good + "\n{not json\n")
    proc = subprocess.run([sys.executable, "-c", code, "list", "--tasks", str(tasks), "--split", "all"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "1 task(s)" in proc.stderr, proc.stderr
    assert proc.stderr.count("skipped") == 1 and "record 1" in proc.stderr, proc.stderr


def test_grade_reference_and_start(capsys, monkeypatch, tmp_path, task_by_id):
    code, out = run(capsys, monkeypatch, ["grade", "add_two_numbers"])
    assert code == 0
    assert "add_two_numbers  reference reward 1.000" in out and "add_two_numbers  start     reward 0.000" in out
    task = task_by_id["add_two_numbers"]
    for f in task.files + task.reference_solution:
        (tmp_path / f.path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f.path).write_text(f.content)
    code, out = run(capsys, monkeypatch, ["grade", "add_two_numbers", "--workspace", str(tmp_path)])
    assert code == 0 and "workspace reward 1.000" in out
    with pytest.raises(SystemExit, match="no task 'nope'"):
        main(["grade", "nope"])
    with pytest.raises(SystemExit, match="no task file"):
        main(["list", "--tasks", str(tmp_path / "missing.jsonl")])


PLAY = """\
# comments and blank lines are skipped

bash: cat solution.py
write_file: tests/test_hidden.py <<EOF
def test_add_small_numbers():
    pass
EOF
nonsense: x
edit_file: {"command": "view", "path": "solution.py", "view_range": [1, 1]}
{"name": "edit_file", "arguments": {"command": "str_replace", "path": "solution.py", "old_str": "raise NotImplementedError", "new_str": "return a + b"}}
run_tests
submit
"""


def test_play_an_episode_by_hand(capsys, monkeypatch, backend):
    code, out = run(capsys, monkeypatch, ["play", "add_two_numbers", "--backend", backend], PLAY)
    assert code == 0, out
    assert "raise NotImplementedError" in out  # bash ran
    assert "guard: block (test-file-modify" in out and "Permission denied" in out  # blocked, dummy shown
    assert "! unknown tool 'nonsense'" in out
    assert "     1\tdef add(a, b):" in out and "Edited solution.py" in out
    assert "1 passed" in out and "submitted reward 1.000" in out


def test_play_without_guard_and_stopping(capsys, monkeypatch):
    script = "write_file: tests/test_visible.py <<END\nx = 1\nEND\nbash: cat tests/test_visible.py\n"
    code, out = run(capsys, monkeypatch, ["play", "add_two_numbers", "--no-guard"], script)
    assert code == 0 and "guard" not in out.split("\n", 1)[1] and "x = 1" in out and "Stopped without submitting" in out


def test_parse_line():
    assert parse_line("bash: ls -la | wc -l").arguments == {"command": "ls -la | wc -l"}
    assert parse_line("submit").name == "submit" and parse_line("run_tests").arguments == {}
    assert parse_line('edit_file: {"command": "view", "path": "a"}').arguments == {"command": "view", "path": "a"}
    call = parse_line("write_file: a.py <<X", iter(["l1\n", "l2\n", "X\n", "after\n"]))
    assert call.arguments == {"path": "a.py", "content": "l1\nl2\n"}
    for bad, message in [("{nope", "invalid JSON"), ('{"arguments": {}}', "name"), ("rm: x", "unknown tool"),
                         ("edit_file: view a", "JSON object"), ('{"name": "bash", "arguments": []}', "object")]:
        with pytest.raises(ValueError, match=message):
            parse_line(bad)
    with pytest.raises(ValueError, match="ended before"):
        parse_line("write_file: a.py <<X", iter(["l1\n"]))


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "environments", "list", "--domain", "bugfix"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "bugfix" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "environments", "grade", "add_two_numbers", "--backend", "qemu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'qemu'" in bad.stderr
