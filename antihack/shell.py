"""Shell commands as the rules see them: every simple command (argv), its redirections, and the scripts it
carries inline (`bash -c`, `sh -c`, `eval`, `python -c`, heredocs fed to an interpreter, `$(...)`).

Parsing uses bashlex, a real bash parser (pipelines, lists, loops, compound commands, substitutions). What
bashlex rejects (`[[ ]]`, unbalanced quotes, exotic syntax) falls back to a tokenizer on the control operators,
so a rule always sees the words. Nothing is ever executed.
"""

from __future__ import annotations

import functools
import re
import shlex

from antihack.shell_reader import read_shell
from antihack.shell_types import VAR_REF, ShellCommand

__all__ = ["ShellCommand", "parse_shell"]

_CONTROL = {";", "&&", "||", "|", "&", "(", ")", "\n", "{", "}"}
_SHELLS = {"bash", "sh", "dash", "zsh", "ksh"}
_HEREDOC = re.compile(r"(?<!<)<<(?!<)(-?)[ \t]*(['\"]?)([A-Za-z_][\w.-]*)\2")  # not <<< (a here-string)


def _lift_heredocs(command: str) -> tuple[str, dict[str, str]]:
    """Replace each here-document by a here-string placeholder and return the bodies (bashlex mishandles
    quoted delimiters such as <<'EOF', and the token reader knows no here-documents at all)."""
    lines = command.split("\n")
    out: list[str] = []
    bodies: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        matches = list(_HEREDOC.finditer(line))
        keys = [f"__HEREDOC_{len(bodies) + n}__" for n in range(len(matches))]
        for m, key in reversed(list(zip(matches, keys))):
            line = line[:m.start()] + f"<<< {key}" + line[m.end():]
        out.append(line)
        for m, key in zip(matches, keys):
            strip, delim, body = bool(m.group(1)), m.group(3), []
            i += 1
            while i < len(lines) and (lines[i].strip() if strip else lines[i]) != delim:
                body.append(lines[i].lstrip("\t") if strip else lines[i])
                i += 1
            bodies[key] = "\n".join(body)
        i += 1
    return "\n".join(out), bodies


_SIMPLE = re.compile(r"[^\w \t./:=,@%+-]")  # any character with shell meaning beyond plain words
# Beyond quotes and the list/pipeline operators: expansions, escapes, redirections, subshells, groups,
# comments, here-documents, negation and [[ ]] need the real parser.
_NEEDS_PARSER = re.compile(r"[$`\\<>(){}#\n!]|\[\[")
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


def parse_shell(command: str, depth: int = 0) -> list[ShellCommand]:
    """The commands of a shell string (cached; the result must be treated as read-only)."""
    return list(_parse_cached(command, depth))


@functools.lru_cache(maxsize=4096)
def _parse_cached(command: str, depth: int) -> tuple[ShellCommand, ...]:
    if not _SIMPLE.search(command):  # plain words only (`ls tests`, `python -m pytest -q`): no parser needed
        return tuple(_expand([ShellCommand(command.split())], depth)) if command.split() else ()
    if not _NEEDS_PARSER.search(command):  # quotes and ; && || | & only: a few µs instead of bashlex's ~1 ms
        commands = _split_quoted_list(command)
        if commands is not None:
            return tuple(_expand(commands, depth))
    return tuple(_parse_full(command, depth))


def _split_quoted_list(command: str) -> list[ShellCommand] | None:
    """Simple commands of a list/pipeline whose only syntax is quoting (no $, escapes or redirections, so the
    inside of quotes is literal); None on unbalanced quotes. Gives what bashlex gives for the same text
    (tests/antihack check this on every such command of the corpora): leading NAME=value words are
    assignments, not argv."""
    commands: list[ShellCommand] = []
    words: list[str] = []
    word: list[str] = []
    quote = ""
    quoted = False

    def end_word() -> None:
        nonlocal quoted
        if word or quoted:
            words.append("".join(word))
            word.clear()
            quoted = False

    def end_command() -> None:
        end_word()
        if words:
            i = 0
            while i < len(words) and _ASSIGNMENT.match(words[i]):
                i += 1
            commands.append(ShellCommand(words[i:]))
            words.clear()

    for ch in command:
        if quote:
            if ch == quote:
                quote = ""
            else:
                word.append(ch)
        elif ch in "'\"":
            quote, quoted = ch, True
        elif ch in " \t":
            end_word()
        elif ch in ";&|":
            end_command()
        else:
            word.append(ch)
    if quote:
        return None
    end_command()
    return commands


READER_STATS = {"reader": 0, "bashlex": 0, "tokens": 0}  # how the full parses of this process were read


def _parse_full(command: str, depth: int) -> list[ShellCommand]:
    text, bodies = _lift_heredocs(command)
    commands = read_shell(text)
    if commands is not None:
        READER_STATS["reader"] += 1
    else:  # what our reader does not understand: bashlex
        try:
            commands = _parse_bashlex(text)
            READER_STATS["bashlex"] += 1
        except Exception:  # bashlex rejects some valid bash (and all invalid bash): read the words anyway
            commands = _parse_tokens(text)
            READER_STATS["tokens"] += 1
    for cmd in commands:
        for i, (op, target) in enumerate(cmd.redirects):
            if op == "<<<" and target in bodies:
                cmd.stdin_script = bodies[target]
                cmd.redirects[i] = ("<<", "EOF")
    return _expand(commands, depth)


def _expand(commands: list[ShellCommand], depth: int) -> list[ShellCommand]:
    """Add the commands that others carry: wrapped commands and inline scripts."""
    out = list(commands)
    if depth >= 3:
        return out
    for cmd in commands:
        wrapped = _unwrap(cmd)
        if wrapped is not None:
            out.extend(_expand([wrapped], depth + 1))
        for script in _inline_scripts(cmd):
            out.extend(parse_shell(script, depth + 1))
    return out


def _parse_bashlex(command: str) -> list[ShellCommand]:
    import bashlex

    out: list[ShellCommand] = []
    env: dict[str, str] = {}  # simple NAME=value assignments and loop variables, expanded in later words

    def expand(word: str) -> str:
        return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), word)

    def visit(node) -> None:
        kind = node.kind
        if kind == "for":
            words = [p.word for p in node.parts if p.kind == "word"]
            if len(words) >= 2:
                env[words[0]] = " ".join(expand(w) for w in words[1:])
        if kind == "command":
            cmd = ShellCommand([])
            for part in node.parts:
                if part.kind == "assignment":
                    name, _, value = part.word.partition("=")
                    env[name] = expand(value)
                if part.kind == "word":
                    cmd.argv.append(expand(part.word))
                    _visit_substitutions(part, visit)
                elif part.kind == "redirect":
                    target = part.output
                    if hasattr(target, "word"):
                        text = expand(target.word)
                    else:
                        text = f"&{target}"
                    op = part.type
                    if op in (">&", "<&"):
                        text, op = (f"&{text.lstrip('&')}" if text.lstrip("&").isdigit() else text), op[0]
                    if getattr(part, "heredoc", None) is not None:
                        body = part.heredoc.value
                        cmd.stdin_script = body.rsplit("\n", 1)[0] if "\n" in body else body
                    elif op == "<<<":
                        cmd.stdin_script = text
                    cmd.redirects.append((op, text))
                elif part.kind == "assignment":
                    _visit_substitutions(part, visit)
            out.append(cmd)
            return
        for attr in ("parts", "list"):
            for child in getattr(node, attr, None) or []:
                visit(child)
        if kind == "commandsubstitution":
            visit(node.command)

    for tree in bashlex.parse(command):
        visit(tree)
    return out


def _visit_substitutions(node, visit) -> None:
    for part in getattr(node, "parts", None) or []:
        if part.kind in ("commandsubstitution", "processsubstitution"):
            visit(part.command)
        else:
            _visit_substitutions(part, visit)


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: fall back to plain words
        return command.split()


def _parse_tokens(command: str) -> list[ShellCommand]:
    out: list[ShellCommand] = []
    current = ShellCommand([])
    tokens = _tokens(command.replace("\n", " ; "))
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.isdigit() and i + 1 < len(tokens) and tokens[i + 1][:1] in "<>":  # 2>, 2>>, 2>&
            tok = tok + tokens[i + 1]
            i += 1
        if tok in _CONTROL or tok in ("[[", "]]"):
            if current.argv or current.redirects:
                out.append(current)
            current = ShellCommand([])
        elif tok.lstrip("0123456789")[:1] in ("<", ">") or tok == "&>":
            target = tokens[i + 1] if i + 1 < len(tokens) else ""
            i += 1
            if tok.endswith("&") and tok != "&>":  # >&1, 2>&1: a descriptor, not a file
                target, tok = "&" + target, tok[:-1]
            current.redirects.append((tok, target))
        else:
            current.argv.append(tok)
        i += 1
    if current.argv or current.redirects:
        out.append(current)
    return out


_WRAPPERS = {"xargs", "sudo", "env", "nohup", "timeout", "nice", "setsid", "stdbuf", "time", "command", "exec",
             "ionice", "chronic", "unbuffer"}


def _unwrap(cmd: ShellCommand) -> ShellCommand | None:
    """`timeout 5 curl x` runs `curl x`: the wrapped command, with the wrapper's redirections and stdin."""
    if cmd.name not in _WRAPPERS or len(cmd.argv) < 2:
        return None
    rest = cmd.argv[1:]
    while rest and (rest[0].startswith("-") or "=" in rest[0]):
        rest = rest[1:]
    if cmd.name == "timeout" and rest:
        rest = rest[1:]  # the duration
    if not rest:
        return None
    return ShellCommand(rest, list(cmd.redirects), stdin_script=cmd.stdin_script)


def _inline_scripts(cmd: ShellCommand) -> list[str]:
    """Shell text carried by a command, to be read as commands too (python code is kept on the command)."""
    argv = cmd.argv
    if cmd.name in _SHELLS:
        if "-c" in argv[1:-1]:
            return [argv[argv.index("-c") + 1]]
        if cmd.stdin_script:
            return [cmd.stdin_script]
    elif cmd.name == "eval" and len(argv) > 1:
        return [" ".join(argv[1:])]
    elif cmd.is_python:
        if "-c" in argv[1:-1]:
            cmd.python_code.append(argv[argv.index("-c") + 1])
        elif cmd.stdin_script and (len(argv) == 1 or argv[1] == "-"):
            cmd.python_code.append(cmd.stdin_script)
    return []
