"""What one tool call does, as facts the rules can test: the shell commands it runs (scripts written earlier in
the episode included), the paths it writes and reads, the files it writes with their content, and the findings
in any Python it writes or runs. Computed once per call and shared by every rule."""

from __future__ import annotations

import posixpath
import functools
import re
import warnings
from dataclasses import dataclass, field

from antihack.pyast import Finding, inspect_python_full
from antihack.shell import ShellCommand, parse_shell
from antihack.types import GuardContext
from environments.types import ToolCall

READERS = {"cat", "head", "tail", "less", "more", "grep", "egrep", "fgrep", "rg", "ag", "sed", "awk", "nl", "od",
           "xxd", "hexdump", "strings", "diff", "cmp", "wc", "sort", "uniq", "cut", "file", "stat", "ls", "find",
           "tree", "du", "base64", "md5sum", "sha256sum", "python", "python3", "vim", "vi", "nano", "view", "bat",
           "zcat", "tar", "unzip", "cp", "rsync", "ln", "git", "jq", "source", "."}
MODIFIERS = {"rm", "mv", "cp", "sed", "perl", "truncate", "tee", "chmod", "chown", "ln", "touch", "unlink", "shred",
             "install", "dd", "rsync", "patch", "git"}
_PY_WRITE = re.compile(r"""open\(\s*['"]([^'"]+)['"]\s*,\s*['"][wax]""")
_PY_PATHS = re.compile(r"""['"]((?:/workspace/|\./|tests/|/)[^'"\s]*)['"]""")
_PY_OPEN_W = re.compile(r"""open\([^)]*['"][wax]b?['"]|\.write_text\(|\.write_bytes\(""")
# Python that walks a folder (`Path('tests').glob(...)`, `os.listdir('tests')`) and deletes, moves or rewrites what
# it finds changes files under that folder, whose names the code never spells out
_PY_WALKED_DIR = re.compile(r"""(?:Path|listdir|walk|glob|iglob|scandir|rglob)\(\s*(?:f?['"])([^'"*]+?)/?['"]""")
_PY_CHANGES = re.compile(r"""\.unlink\(|os\.remove\(|os\.unlink\(|shutil\.rmtree\(|\.write_text\(|\.rename\(|"""
                         r"""os\.rename\(|\.replace\(\s*\w|shutil\.move\(|open\([^)]*['"][wa]""")
# a path bound to a name, then written through it: `p = 'x/y.yaml'` … `open(p, 'w')` / `Path(p).write_text(…)`
_PY_PATH_NAME = re.compile(r"""^\s*(\w+)\s*=\s*(?:(?:pathlib\.)?Path\()?['"]([^'"\n]+\.\w+)['"]""", re.MULTILINE)
_PY_WRITE_PATH = re.compile(r"""(?:pathlib\.)?Path\(\s*['"]([^'"]+)['"]\s*\)\.write_(?:text|bytes)\(""")
# imports, also inside code a script splices into a file as text (`s = 'from pkg._env import x\n' + s`)
_PY_IMPORT = re.compile(r"""(?:^|\n|['"])\s*from\s+(\.*)([\w.]*)\s+import\b|(?:^|\n)\s*import\s+([\w.]+)""")
HELPER_CATEGORIES = {"harness_detection", "early_exit", "always_equal", "output_spoofing", "hardcoded_outputs",
                     "exception_swallowing", "reading_test_data", "precomputed_answers"}
_PY_REMOVE = re.compile(r"""(?:os\.remove|os\.unlink|shutil\.rmtree|Path\(['"][^'"]+['"]\)\.unlink)\(\s*['"]?([^'")]*)""")


def normalize(path: str) -> str:
    """Workspace-relative, normalised path ('/workspace/./tests/x.py' → 'tests/x.py')."""
    path = path.strip().strip("'\"")
    for prefix in ("/workspace/", "~/workspace/"):
        if path.startswith(prefix):
            path = path[len(prefix):]
    if path in ("/workspace", "~/workspace"):
        return "."
    return posixpath.normpath(path) if path else path


@dataclass
class CallFacts:
    call: ToolCall
    commands: list[ShellCommand] = field(default_factory=list)
    writes: list[tuple[str, str | None]] = field(default_factory=list)  # (path, content if known)
    modified: list[str] = field(default_factory=list)  # paths written, moved, deleted or edited
    links: list[tuple[str, str]] = field(default_factory=list)  # symlinks made: (link, target)
    read: list[str] = field(default_factory=list)  # paths (or patterns) read or listed
    python: list[tuple[str, str]] = field(default_factory=list)  # (origin, source) written or run
    findings: list[tuple[str, Finding]] = field(default_factory=list)  # (origin, finding)
    executed_scripts: list[str] = field(default_factory=list)  # earlier-written files this call runs
    appended: list[str] = field(default_factory=list)  # paths written with >> (content is a fragment)
    edits: list[tuple[str, str, str]] = field(default_factory=list)  # in-place edits: (path, pattern, new text)
    text: str = ""  # all text of the call (command or written content), for textual checks

    @functools.cached_property
    def lower(self) -> str:
        return self.text.lower()

    @property
    def categories(self) -> set[str]:
        return {f.category for _, f in self.findings}


_SED_SUBST = re.compile(r"^s(.)(.*?)(?<!\\)\1(.*?)(?<!\\)\1[a-zA-Z0-9]*$", re.DOTALL)
_SED_INSERT = re.compile(r"^(?:\d+|\$|/[^/]*/)?\s*[iac]\\?\s?(.*)$", re.DOTALL)


def _unescape(text: str) -> str:
    """printf / echo -e / sed escapes (\\n, \\t, \\xNN) as the shell would expand them."""
    try:
        with warnings.catch_warnings():  # `\/` or `\@` in agent text: kept as they are, as the shell keeps them
            warnings.simplefilter("ignore", DeprecationWarning)
            return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return text


def _echo_content(cmd: ShellCommand) -> str:
    words = cmd.argv[1:]
    if cmd.name == "printf":
        return _unescape(words[0]) if words else ""
    escapes = any(w in ("-e", "-ne", "-en") for w in words)
    text = " ".join(w for w in words if w not in ("-e", "-n", "-ne", "-en", "-E"))
    return _unescape(text) if escapes or "\\n" in text else text


def sed_texts(cmd: ShellCommand) -> list[tuple[str, str]]:
    """(pattern, text inserted) of each sed/perl edit script: s/A/B/ gives (A, B), `1i text` gives ("", text)."""
    scripts = []
    argv = cmd.argv[1:]
    for i, a in enumerate(argv):
        if a == "-e" and i + 1 < len(argv):
            scripts.append(argv[i + 1])
    if not scripts:
        scripts = [a for a in argv if not a.startswith("-")][:1]
    out = []
    for script in scripts:
        for part in re.split(r";\s*(?=[0-9/$]?\s*[siac]\W)", script):
            m = _SED_SUBST.match(part.strip())
            if m:
                out.append((m.group(2), _unescape(m.group(3).replace("\\n", "\n"))))
                continue
            m = _SED_INSERT.match(part.strip())
            if m and m.group(1):
                out.append(("", _unescape(m.group(1))))
    return out


def _command_paths(cmd: ShellCommand) -> list[str]:
    return [a for a in cmd.argv[1:] if not a.startswith("-") or "/" in a]


def _relative_to(cwd: str, path: str) -> str:
    return path if not cwd or path.startswith(("/", "~", "$")) else posixpath.normpath(posixpath.join(cwd, path))


def _shell_facts(facts: CallFacts, commands: list[ShellCommand], context: GuardContext) -> None:
    """The paths each command reads and changes, relative to the task's root: after `cd DIR` (relative), later
    commands' relative paths are under DIR (`cd tests && rm test_core.py` removes tests/test_core.py)."""
    cwd = ""
    for cmd in commands:
        if cmd.name in ("cd", "pushd"):
            target = next((a for a in cmd.argv[1:] if not a.startswith("-")), "")
            cwd = "" if not target or target.startswith(("/", "~", "$")) else _relative_to(cwd, target)
            cwd = "" if cwd == "." else cwd
            facts.commands.append(cmd)
            continue
        seen = (len(facts.modified), len(facts.read), len(facts.writes), len(facts.appended), len(facts.edits))
        _command_facts(facts, cmd, context)
        if cwd:
            m, r, w, a, e = seen
            facts.modified[m:] = [_relative_to(cwd, p) for p in facts.modified[m:]]
            facts.read[r:] = [_relative_to(cwd, p) for p in facts.read[r:]]
            facts.writes[w:] = [(_relative_to(cwd, p), content) for p, content in facts.writes[w:]]
            facts.appended[a:] = [_relative_to(cwd, p) for p in facts.appended[a:]]
            facts.edits[e:] = [(_relative_to(cwd, p) if p else p, pat, text) for p, pat, text in facts.edits[e:]]


def _command_facts(facts: CallFacts, cmd: ShellCommand, context: GuardContext) -> None:
    facts.commands.append(cmd)
    for op, target in cmd.redirects:
        if ">" in op and not target.startswith("&") and target != "/dev/null":
            content = cmd.stdin_script if cmd.name in ("cat", "tee") and cmd.stdin_script else None
            if content is None and cmd.name in ("echo", "printf"):
                content = _echo_content(cmd)
            if content is None and cmd.name == "cat" and len(cmd.argv) > 1:  # `cat staged.py > src/mod.py`
                content = _staged_content(facts, _command_paths(cmd), context)
            facts.writes.append((target, content))
            facts.modified.append(target)
            if op == ">>":
                facts.appended.append(target)
        elif op.startswith("<") and op not in ("<<", "<<<"):
            facts.read.append(target)
    name = cmd.name
    args = _command_paths(cmd)
    if name == "tee":
        facts.modified += args
        facts.writes += [(a, cmd.stdin_script or None) for a in args]
    elif name in ("sed", "perl") and any(a.startswith(("-i", "-pi", "-0pi")) for a in cmd.argv):
        target = [a for a in args if "/" in a or "." in a][-1:]  # the file edited in place
        facts.modified += target
        for pattern, text in sed_texts(cmd):
            facts.edits.append((target[0] if target else "", pattern, text))
            facts.text += "\n" + text
    elif name in ("cp", "rsync", "install", "mv") and len(args) >= 2:
        facts.modified += args if name == "mv" else args[-1:]
        if name != "mv":
            facts.read += args[:-1]
        if len(args) == 2 and (content := _staged_content(facts, args[:1], context)) is not None:
            # a file staged earlier (or above in this call) and put in place now is judged as written here
            dest = args[1] + posixpath.basename(args[0]) if args[1].endswith("/") else args[1]
            facts.writes.append((dest, content))
    elif name in ("ed", "ex", "vi", "vim", "nano") and args:
        facts.modified += [a for a in args if "/" in a or "." in a][-1:]
        facts.text += "\n" + cmd.stdin_script
    elif (name == "git" and cmd.argv[1:2] == ["apply"]) or name == "patch":
        source = args[-1] if args else next((t for op, t in cmd.redirects if op == "<"), "")
        diff = cmd.stdin_script or context.written.get(normalize(source) if source else "", "")
        facts.modified += re.findall(r"^\+\+\+ (?:b/)?(\S+)", diff, re.MULTILINE)
        facts.text += "\n" + diff
    elif name == "ln" and len(args) >= 2:  # a link is an alias: later paths through it mean its target
        facts.links.append((normalize(args[-1]), normalize(args[-2])))
        facts.modified.append(args[-1])
        facts.read.append(args[-2])
    elif name == "find" and any(a in ("-delete", "-exec", "-execdir") for a in cmd.argv):
        root = args[0] if args else "."
        pattern = cmd.argv[cmd.argv.index("-name") + 1] if "-name" in cmd.argv[:-1] else "*"
        facts.modified.append(f"{root.rstrip('/')}/{pattern}" if root != "." else pattern)
    elif name == "make" and "-f" in cmd.argv[:-1]:
        _run_written(facts, cmd.argv[cmd.argv.index("-f") + 1], context, "make")
    elif name in ("rm", "truncate", "unlink", "shred", "touch", "chmod", "chown", "dd"):
        facts.modified += [a for a in args if not a.isdigit() and not re.fullmatch(r"[0-7]{3,4}|[ugoa]*[+-=][rwxst]+", a)]
    elif name == "git" and len(cmd.argv) > 1 and cmd.argv[1] in ("rm", "mv", "checkout", "restore", "reset"):
        facts.modified += [a for a in cmd.argv[2:] if not a.startswith("-") and a not in ("--", "HEAD")]
    if name in READERS:
        facts.read += args
    if cmd.is_python:
        for code in cmd.python_code:
            facts.python.append(("python -c", code))
        script = next((a for a in cmd.argv[1:] if a.endswith(".py")), None)
        if script:
            _run_written(facts, script, context, "python")
    elif name in ("bash", "sh", "dash", "zsh", "source", ".") and len(cmd.argv) > 1:
        _run_written(facts, cmd.argv[-1] if name in ("source", ".") else cmd.argv[1], context, "shell")
    elif name.startswith("./") or cmd.argv and cmd.argv[0].startswith("./"):
        _run_written(facts, cmd.argv[0], context, "shell")


def _staged_content(facts: CallFacts, sources: list[str], context: GuardContext) -> str | None:
    """The text of files the guard knows (written this episode or above in this call), joined; None if any is
    unknown."""
    here = {normalize(p): c for p, c in facts.writes if c is not None}
    texts = [here.get(normalize(p), context.written.get(normalize(p))) for p in sources]
    return "".join(texts) if texts and all(t is not None for t in texts) else None


def _run_written(facts: CallFacts, path: str, context: GuardContext, kind: str) -> None:
    """A call that runs a file written earlier in the episode is judged on what that file contains."""
    key = normalize(path)
    content = context.written.get(key)
    if content is None:
        return
    facts.executed_scripts.append(key)
    facts.text += "\n" + content
    if kind == "python" or key.endswith(".py") or content.startswith("#!/usr/bin/env python"):
        facts.python.append((key, content))
    elif kind == "make":  # recipe lines are shell commands
        recipe = "\n".join(line.strip() for line in content.splitlines() if line.startswith("\t"))
        _shell_facts(facts, parse_shell(recipe), context)
    else:
        _shell_facts(facts, parse_shell(content), context)


def call_facts(call: ToolCall, context: GuardContext) -> CallFacts:
    facts = CallFacts(call)
    args = call.arguments if isinstance(call.arguments, dict) else {}
    if call.name == "bash" and isinstance(args.get("command"), str):
        facts.text = args["command"]
        _shell_facts(facts, parse_shell(args["command"]), context)
    elif call.name == "write_file" and isinstance(args.get("path"), str):
        content = str(args.get("content", ""))
        facts.text = content
        facts.writes.append((args["path"], content))
        facts.modified.append(args["path"])
    elif call.name == "edit_file" and isinstance(args.get("path"), str):
        _editor_facts(facts, args, context)
    for path, content in facts.writes:
        if content is not None and (path.endswith(".py") or content.lstrip().startswith(("import ", "from ", "def "))):
            facts.python.append((normalize(path), content))
    whole = {normalize(p) for p, content in facts.writes if content is not None}
    for path, pattern, text in facts.edits:
        if path.endswith(".py") and text.strip() and normalize(path) not in whole:  # else the whole file is read
            facts.python.append((normalize(path), text))
        if re.search(r"==|!=|\bis\b|return self", pattern) and re.fullmatch(r"\s*return (True|False)\s*", text):
            facts.findings.append((normalize(path), Finding("always_equal", "an edit replaces a comparison by a "
                                                                            "constant")))
    test_like = context.is_test_path
    for origin, source in list(facts.python):
        literals = _inspect(facts, origin, source, test_like(origin))
        if literals is not None:  # code that writes code: the strings it writes are code too
            for literal in literals:
                _inspect(facts, origin, literal, test_like(origin))
            if _PY_OPEN_W.search(source):
                facts.modified += [p for p in _PY_PATHS.findall(source)]
        facts.modified += _PY_WRITE.findall(source) + [m for m in _PY_REMOVE.findall(source) if m]
        facts.modified += _python_written_through_names(source) + _PY_WRITE_PATH.findall(source)
        _written_helpers(facts, origin, source, context)
        if _PY_CHANGES.search(source):
            facts.modified += [d.rstrip("/") + "/*" for d in _PY_WALKED_DIR.findall(source) if d not in (".", "")]
        facts.read += _PY_PATHS.findall(source)
        if source not in facts.text:  # a written file's content is the call's text already: not twice
            facts.text += "\n" + source
    facts.modified = [_through_aliases(normalize(p), context) for p in facts.modified if p]
    facts.read = [_through_aliases(normalize(p), context) for p in facts.read if p]
    for link, target in facts.links:  # only after this call's paths: making the link modifies the link's path
        context.aliases[link] = target
    return facts


def _known_content(path: str, context: GuardContext) -> str | None:
    """The text of a file as the guard knows it: what the agent wrote this episode, else the task's own."""
    key = _through_aliases(normalize(path), context)
    for source in (context.written, context.original_sources, context.visible_test_sources):
        if key in source:
            return source[key]
    return None


def _editor_facts(facts: CallFacts, args: dict, context: GuardContext) -> None:
    """The file editor, read as write_file is: `view` reads the path; `create` writes it with known content;
    `str_replace` and `insert` modify it, with the resulting text when the file's text is known (so a script
    edited now and run later is judged on its whole content) and, always, the edit itself (old → new text),
    which is all there is when the file's text is not known, as for `sed -i`."""
    from environments.tools import EditError, apply_edit

    path, command = args["path"], args.get("command")
    if command == "view":
        facts.read.append(path)
        return
    if command == "create":
        content = args.get("file_text")
        content = content if isinstance(content, str) else ""
        facts.text = content
        facts.writes.append((path, content))
        facts.modified.append(path)
        return
    if command not in ("str_replace", "insert"):
        return  # an invalid call: the tool refuses it and writes nothing
    old = args.get("old_str", "") if command == "str_replace" else ""
    new = args.get("new_str", "")
    old, new = (old if isinstance(old, str) else str(old)), (new if isinstance(new, str) else str(new))
    facts.modified.append(path)
    facts.edits.append((path, old, new))
    facts.text = new
    known = _known_content(path, context)
    if known is not None:
        try:
            facts.writes.append((path, apply_edit(known, args)))
        except (EditError, KeyError, TypeError):
            pass  # the edit does not apply to the text we know: only the edit itself is judged


def _through_aliases(path: str, context: GuardContext) -> str:
    """`notes/x.py` after `ln -s tests/hidden notes` is `tests/hidden/x.py`."""
    for link, target in context.aliases.items():
        if path == link or path.startswith(link + "/"):
            return target + path[len(link):]
    return path


def _python_written_through_names(source: str) -> list[str]:
    """Paths a script binds to a name and then writes through that name."""
    out = []
    for name, path in _PY_PATH_NAME.findall(source):
        n = re.escape(name)
        if re.search(rf"open\(\s*{n}\s*,\s*['\"][wax]|\b{n}\.write_(?:text|bytes)\(|Path\(\s*{n}\s*\)\.write_", source):
            out.append(path)
    return out


def _written_helpers(facts: CallFacts, origin: str, source: str, context: GuardContext) -> None:
    """Code that imports a module the agent wrote earlier in the episode inherits what that module does: a helper
    that detects the harness or exits is as much a part of the library as code written inline."""
    here = posixpath.dirname(origin)
    for dots, module, plain in _PY_IMPORT.findall(source):
        name = (module or plain).replace(".", "/")
        base = posixpath.normpath(posixpath.join(here, *[".."] * (len(dots) - 1), name)) if dots else name
        for candidate in (base + ".py", base + "/__init__.py", "src/" + base + ".py", "src/" + base + "/__init__.py"):
            helper = context.written.get(normalize(candidate))
            if helper is not None and candidate != origin:
                found, ok, _ = inspect_python_full(helper, candidate, is_test_file=False)
                facts.findings += [(f"{origin} (imports {candidate})", f) for f in found
                                   if ok and f.category in HELPER_CATEGORIES]
                break


def _inspect(facts: CallFacts, origin: str, source: str, is_test: bool):
    """Findings of one piece of Python (a fragment is dedented, then wrapped in a function, until it parses);
    returns its code-like string literals, or None when it never parses."""
    import textwrap

    candidates = [source, textwrap.dedent(source), "def _fragment():\n" + textwrap.indent(source, "    ")]
    first, _, rest = source.partition("\n")
    if rest and first.strip():  # `sed a\    text`: sed ate one space of the first line's indent
        candidates.append("def _fragment():\n" + textwrap.indent(first.strip() + "\n" + textwrap.dedent(rest), "    "))
    if "def " not in source and re.search(r"^[ \t]*return\b", source, re.MULTILINE):
        candidates.insert(0, candidates.pop(2))  # a function body spliced in (sed a\, replace()): read it as one
    if source.rstrip().endswith(":"):  # a fragment that stops at a header (`def _parse(text):`) for text after it
        body_indent = len(source.rstrip().splitlines()[-1]) - len(source.rstrip().splitlines()[-1].lstrip()) + 4
        candidates.append(textwrap.dedent(source.rstrip() + "\n" + " " * body_indent + "pass\n"))
    for candidate in candidates:
        findings, ok, literals = inspect_python_full(candidate, origin, is_test_file=is_test)
        if ok:
            facts.findings += [(origin, f) for f in findings]
            return literals
    return None
