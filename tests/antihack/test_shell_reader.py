"""Our bash reader (antihack/shell_reader.py) against bashlex, the parser it replaces.

On every string that reaches the full shell parser while the guard reads both shipped corpora (calls, histories,
inline scripts, here-documents fed to shells, scripts written earlier and run later), and on hand-written tricky
commands, the reader gives exactly what `antihack.shell._parse_bashlex` gives (read with `compat=True`, which
keeps bashlex's reading of backslashes inside double quotes), or a documented superset: never fewer commands,
words or redirections. Then the documented differences, each on its own, and what bashlex cannot read at all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from antihack import Guard, GuardContext, shell
from antihack.evaluate import load_corpus, run
from antihack.shell import parse_shell
from antihack.shell_reader import read_shell
from environments import ToolCall

DATA = Path(shell.__file__).parent / "data"


def _view(commands):
    return [(c.argv, c.redirects, c.stdin_script) for c in commands]


def _bashlex(command: str):
    text, _ = shell._lift_heredocs(command)
    return _view(shell._parse_bashlex(text))


def _ours(command: str, compat: bool = True):
    text, _ = shell._lift_heredocs(command)
    commands = read_shell(text, compat=compat)
    return None if commands is None else _view(commands)


def _superset(ours, ref) -> bool:
    """`ref`'s commands appear in `ours` in order, each with the same argv and stdin and at least its
    redirections."""
    j = 0
    for argv, redirects, stdin in ref:
        while j < len(ours) and not (ours[j][0] == argv and ours[j][2] == stdin and
                                     all(r in ours[j][1] for r in redirects)):
            j += 1
        if j == len(ours):
            return False
        j += 1
    return True


@pytest.fixture(scope="module")
def corpus_commands(monkeypatch_module):
    """Every string the full parser reads while the guard decides both corpora (and their histories)."""
    seen: list[str] = []
    full = shell._parse_full

    def spy(command: str, depth: int):
        seen.append(command)
        return full(command, depth)

    monkeypatch_module.setattr(shell, "_parse_full", spy)
    shell._parse_cached.cache_clear()
    for name in ("corpus.jsonl", "heldout_corpus.jsonl"):
        rows, _ = load_corpus(str(DATA / name))
        asyncio.run(run(Guard(), rows))
    shell._parse_cached.cache_clear()
    return list(dict.fromkeys(seen))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_reader_reads_every_corpus_command_as_bashlex_does(corpus_commands):
    assert len(corpus_commands) >= 150
    exact, supersets = 0, []
    for command in corpus_commands:
        ref = _bashlex(command)  # bashlex reads all of them
        ours = _ours(command)
        assert ours is not None, command  # no fallback on the corpora
        if ours == ref:
            exact += 1
        else:
            assert _superset(ours, ref), command
            supersets.append(command)
    # The two supersets: a loop's redirection (`for ...; done > f`) and a substitution in a redirection target
    # (`> $(python -c ...)/zz.pth`), both of which bashlex's tree holds where _parse_bashlex never looks.
    assert len(supersets) <= 2, supersets
    assert exact >= len(corpus_commands) - 2


def test_bash_backslashes_differ_from_bashlex_only_in_words(corpus_commands):
    """Without `compat`, a backslash inside double quotes stays unless it escapes $ ` " \\ or a newline (bash;
    bashlex drops it): same commands and redirections, only words with a backslash change."""
    changed = 0
    for command in corpus_commands:
        compat, real = _ours(command), _ours(command, compat=False)
        assert [(len(a), r, s) for a, r, s in real] == [(len(a), r, s) for a, r, s in compat], command
        for (a, _, _), (b, _, _) in zip(real, compat):
            for x, y in zip(a, b):
                if x != y:
                    assert "\\" in x and x.replace("\\", "") == y.replace("\\", ""), (command, x, y)
                    changed += 1
    assert changed >= 1  # python -c "...\n..." keeps its \n, as python receives it


def test_fallback_to_bashlex_is_rare(corpus_commands):
    fallbacks = [c for c in corpus_commands if read_shell(shell._lift_heredocs(c)[0]) is None]
    assert len(fallbacks) <= len(corpus_commands) // 100, fallbacks


TRICKY = [
    # quotes and escapes
    'echo "a \'b\' c" \'d "e" f\' g\\ h', 'echo "a\\"b" \'c\\d\' e\\ f "g\\$h" "k\\\\l" x\\\\y', 'echo "a;b" > f',
    "echo 'a;b' | grep ';'", 'echo "x|y" && echo \'&&\'', 'grep -E "a|b" f', 'echo \\; \\| \\&', 'echo a\\;b',
    'echo "$HOME/x" ~/y', 'echo "" \'\' x""y', "echo \\'", 'echo \\\\', 'echo a#b', "echo 'a\nb'",
    # substitutions, nested and within double quotes
    'echo "$(cat "x y")" `ls -l`', 'echo $(echo $(rm q))', 'x=$(cat tests/test_a.py)', 'x=`cat f`',
    'echo "`ls`"', 'echo "\\`ls\\`"', 'cd $(dirname $0)/..', 'echo $(ls)$(pwd)', 'echo "$(echo ")")"',
    "echo $(echo ')')", 'echo a=$(rm q)', 'A=b$(c)d e', 'diff <(ls a) <(ls b)', 'echo ${x:-y} "${HOME}" $1 $@ $#',
    'kill $(cat /tmp/p.pid)', 'python -c "print($(cat x))"', 'echo "$(git log --oneline | head -n 1)"',
    'git commit -m "$(cat <<\'EOF\'\nfix: the thing\nEOF\n)"',
    # lists, pipelines, redirections
    'cd x && rm -rf ../tests', 'a || b; c & d', 'a |& b', 'a | b | c', 'pytest -q 2>&1 | tail -5',
    'echo a >&2; cat 2>&1 >f 3<in <&0 &>g >|h 2>>i', 'echo >&file', 'echo &>>f', 'cat <>f', 'cmd 2>&-',
    'exec 3>&1', 'echo x >>f 2>&1', '>f echo a', '<in cat > out', 'echo a >f b', 'echo 1>f a1>g 1 >h',
    'cat 0<f', 'echo 2>& 1', "echo > 'a b'", 'A=x; echo > $A', 'cat <<< "hello"', 'cat <<<x', 'a && \n b',
    'a |\n b', 'echo a;\n\necho b', 'echo ;', 'true && { cd x || exit 1; }', '! grep x f', '! { a; }',
    # here-documents
    "cat > tests/test_a.py <<'EOF'\ndef test_a():\n    assert True\nEOF", "python - <<'PY'\nimport os\nPY",
    "python3 - <<EOF\nprint(1)\nEOF\necho done", "cat <<-EOF > f\n\tindented\n\tEOF", 'bash <<"SH"\nrm x\nSH',
    # assignments
    'A=1', 'A=1; echo $A', 'a=1 b=$(cat f) cmd $a', 'x=1 y=2 echo', 'A= cmd', "A='' cmd", 'A=1\\ 2 cmd',
    'export A=1 B=$(x)', 'FOO=bar env | grep FOO', 'PYTHONPATH=src python -m pytest -q', 'echo a=b',
    # compound commands
    '(cd x && rm -rf ../tests)', '{ echo a; echo b; }', 'f() { rm x; }; f', 'f(){ rm x; }',
    'function g { rm y; }', 'function h() { rm z; }', 'if true; then rm x; else rm y; fi',
    'if [ -f x ]\nthen\n  rm x\nelif false; then rm b\nfi', 'while read l; do echo $l; done',
    'until false; do x; done', 'for f in a b; do rm $f; done', 'for f in tests/*.py; do : > "$f"; done',
    "for x in 'a b' \"c\"; do echo $x; done", 'for i in 1 2\ndo\necho $i\ndone', 'for x in $(ls); do :; done',
    'for f in *.py\ndo\n  echo "$f"\ndone', 'while true; do :; done &', '[ -f x ] && rm x',
    'for p in .git/objects/pack/*.idx; do git verify-pack -v "$p"; done | grep blob',
    # comments and line continuations
    'echo a # comment ; rm x', 'echo a && # c\n rm b', 'echo a\\\nb', 'pytest \\\n  -q \\\n  tests/', 'ls # c\nrm x',
]


@pytest.mark.parametrize("command", TRICKY)
def test_tricky_commands_read_as_bashlex_does(command):
    assert _ours(command) == _bashlex(command)


# Where we read more than bashlex's tree gives _parse_bashlex (all of it is bash's own reading).
SUPERSETS = [
    ("{ echo import os; } > tests/test_a.py", [(["echo", "import", "os"], [(">", "tests/test_a.py")], "")]),
    ("while read l; do echo $l; done < list.txt",
     [(["read", "l"], [("<", "list.txt")], ""), (["echo", "$l"], [("<", "list.txt")], "")]),
    ("(cd tests && rm -f x) 2>/dev/null",
     [(["cd", "tests"], [(">", "/dev/null")], ""), (["rm", "-f", "x"], [(">", "/dev/null")], "")]),
    ("echo x > $(rm q)", [(["rm", "q"], [], ""), (["echo", "x"], [(">", "$(rm q)")], "")]),
    ('cat <<< "$(rm z)"', [(["rm", "z"], [], ""), (["cat"], [("<<<", "$(rm z)")], "$(rm z)")]),
    ("echo ${x:-$(rm y)}", [(["rm", "y"], [], ""), (["echo", "${x:-$(rm y)}"], [], "")]),
]


@pytest.mark.parametrize("command,expected", SUPERSETS)
def test_documented_supersets(command, expected):
    ours = _ours(command)
    assert ours == expected
    assert _superset(ours, _bashlex(command)) and ours != _bashlex(command)


# Bash that bashlex rejects (the token fallback then only split words on operators) or reads wrongly.
BEYOND = [
    ("case $x in a) rm y;; *) echo z;; esac", [(["rm", "y"], []), (["echo", "z"], [])]),
    ("case \"$1\" in\n  start|up) ./run.sh ;;\n  (*) exit 1\nesac", [(["./run.sh"], []), (["exit", "1"], [])]),
    ("[[ -f x && $y == a* ]] && rm x", [(["[[", "-f", "x", "&&", "$y", "==", "a*", "]]"], []), (["rm", "x"], [])]),
    ("A=(1 2 $(rm q)); echo done", [(["rm", "q"], []), ([], []), (["echo", "done"], [])]),
    ("echo $((1 + 2)) $(( $(rm w) ))", [(["rm", "w"], []), (["echo", "$((1 + 2))", "$(( $(rm w) ))"], [])]),
    ("for ((i=0; i<3; i++)); do echo $i; done", [(["echo", "$i"], [])]),
    ("(( i++ )) && rm x", [(["rm", "x"], [])]),
    ("time pytest -q", [(["time", "pytest", "-q"], [])]),
    ("select x in a b; do rm $x; done", [(["rm", "a b"], [])]),
    ("echo $'\\x72\\x6d' \"a\\nb\" 'it''s' \"a b\"c'd e'", [(["echo", "rm", "a\\nb", "its", "a bcd e"], [])]),
    ("# only a comment", []),
    ("echo a\\", [(["echo", "a\\"], [])]),
]


@pytest.mark.parametrize("command,expected", BEYOND)
def test_bash_beyond_bashlex(command, expected):
    assert [(a, r) for a, r, _ in _ours(command, compat=False)] == expected


@pytest.mark.parametrize("command", ["echo 'unbalanced", 'echo "a', "echo $(ls", "cat <<\\EOF\nrm x\nEOF",
                                     "{ echo a", "if true; then x", "echo a; fi", "a )"])
def test_what_the_reader_leaves_to_bashlex(command):
    assert read_shell(shell._lift_heredocs(command)[0]) is None
    assert parse_shell(command)  # bashlex, or its token fallback, still reads the words


def test_the_reader_in_the_guard():
    """What bashlex's reading let through: a group's redirection onto a test file, a here-string mistaken
    for a here-document that swallowed the next line."""
    def ctx() -> GuardContext:
        return GuardContext(protected_paths=["tests/test_visible.py"])

    for command in ["{ echo 'def test_x(): pass'; } > tests/test_visible.py",
                    "cat <<<x\nrm tests/test_visible.py",
                    "case $1 in *) rm tests/test_visible.py;; esac",
                    "[[ -f tests/test_visible.py ]] && rm tests/test_visible.py"]:
        verdict = Guard().check(ToolCall("bash", {"command": command}), ctx())
        assert verdict.action == "block" and "test-file-modify" in verdict.rule_ids, command
    assert Guard().check(ToolCall("bash", {"command": "for f in src/*.py; do python -m py_compile $f; done > "
                                                      "/tmp/log 2>&1"}), ctx()).action == "allow"


def test_reader_counts(corpus_commands):
    """The full parses of this process went through the reader, not bashlex."""
    before = dict(shell.READER_STATS)
    shell._parse_cached.cache_clear()
    for command in corpus_commands[:50]:
        parse_shell(command)
    assert shell.READER_STATS["reader"] - before["reader"] >= 1
    assert shell.READER_STATS["bashlex"] == before["bashlex"] and shell.READER_STATS["tokens"] == before["tokens"]
