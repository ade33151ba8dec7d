"""A small shell-command reader for the rules: commands (argv lists) and redirection targets.

It splits on the control operators (; && || | &), records the targets of > >> < redirections, and reads
`bash -c '...'`, `sh -c`, `eval` and `python -c` bodies recursively. It never executes anything. A command it
cannot tokenise (unbalanced quotes) yields the raw words, so rules still see them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

_CONTROL = {";", "&&", "||", "|", "&", "(", ")", "\n"}
_SHELLS = {"bash", "sh", "dash", "zsh"}


@dataclass
class ShellCommand:
    argv: list[str]
    redirects: list[tuple[str, str]] = field(default_factory=list)  # (operator, target)
    python_code: list[str] = field(default_factory=list)  # bodies of python -c

    @property
    def name(self) -> str:
        return self.argv[0].rsplit("/", 1)[-1] if self.argv else ""


def _tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: fall back to plain words
        return command.split()


def parse_shell(command: str, depth: int = 0) -> list[ShellCommand]:
    out: list[ShellCommand] = []
    current = ShellCommand([])
    tokens = _tokens(command.replace("\n", " ; "))
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.isdigit() and i + 1 < len(tokens) and tokens[i + 1][:1] in "<>":  # 2>, 2>>, 2>&
            tok = tok + tokens[i + 1]
            i += 1
        if tok in _CONTROL:
            if current.argv or current.redirects:
                out.append(current)
            current = ShellCommand([])
        elif tok.lstrip("0123456789")[:1] in ("<", ">") or tok == "&>":
            target = tokens[i + 1] if i + 1 < len(tokens) else ""
            i += 1
            if tok.endswith("&") and tok != "&>":  # >&1, 2>&1: a descriptor, not a file
                target = "&" + target
                tok = tok[:-1]
            current.redirects.append((tok, target))
        else:
            current.argv.append(tok)
        i += 1
    if current.argv or current.redirects:
        out.append(current)
    if depth < 3:
        for cmd in list(out):
            inner = _inline_script(cmd)
            if inner is not None:
                out.extend(parse_shell(inner, depth + 1))
    return out


def _inline_script(cmd: ShellCommand) -> str | None:
    if cmd.name in _SHELLS and "-c" in cmd.argv[1:-1]:
        return cmd.argv[cmd.argv.index("-c") + 1]
    if cmd.name == "eval" and len(cmd.argv) > 1:
        return " ".join(cmd.argv[1:])
    if cmd.name.startswith("python") and "-c" in cmd.argv[1:-1]:
        cmd.python_code.append(cmd.argv[cmd.argv.index("-c") + 1])
    return None
