"""The shell reader's lexer: bash words (quotes, escapes, `$'...'`, substitutions) and operators.

`antihack.shell_reader` builds the command structure from what `Lexer` yields; the matchers here find where a
quote, a substitution or a bracket ends, and `substitutions` finds the commands inside text that is not read
as words.
"""

from __future__ import annotations

import re

_PLAIN = re.compile(r"[^ \t\n'\"\\$`;&|<>()]+")  # unquoted characters with no meaning inside a word
_DQ_PLAIN = re.compile(r"[^\"\\$`]*")  # characters with no meaning inside double quotes
_IO_NUMBER = re.compile(r"\d+(?=[<>])")
_REDIRECT = re.compile(r"<<<|<<-|<<|<>|<&|<|>>|>&|>\||>")
ASSIGNMENT_WORD = re.compile(r"[A-Za-z_]\w*\+?=")  # NAME= or NAME+=
_METACHARS = frozenset(" \t\n;&|<>()")



class Unreadable(Exception):
    """Something this reader does not understand: the caller falls back to bashlex."""


class Word:
    __slots__ = ("quoted", "raw", "subs", "value")

    def __init__(self, value: str, raw: str, subs: list[str], quoted: bool):
        self.value, self.raw, self.subs, self.quoted = value, raw, subs, quoted


_QUOTING = "\\'\""  # the characters _skip_quoting steps over


def _skip_quoting(s: str, i: int, c: str) -> int:
    """Index just after the quoting that starts at `i` with `c` (one of _QUOTING): a backslash escape, a
    single-quoted string, or a double-quoted string."""
    if c == "\\":
        return i + 2
    if c == "'":
        j = s.find("'", i + 1)
        if j < 0:
            raise Unreadable("unbalanced quote")
        return j + 1
    return _skip_dq(s, i + 1)


def _match_closer(s: str, i: int, opener: str, closer: str) -> int:
    """Index of the `closer` that closes an `opener` just before `i`: quotes, escapes, backticks and `$(...)`
    skipped, nested openers counted."""
    depth, n = 1, len(s)
    while i < n:
        c = s[i]
        if c in _QUOTING:
            i = _skip_quoting(s, i, c)
            continue
        if c == "`":
            i = _match_backtick(s, i + 1) + 1
            continue
        if c == "$" and opener != "(" and s.startswith("$(", i):
            i = _match_closer(s, i + 2, "(", ")") + 1
            continue
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise Unreadable(f"unbalanced {opener}{closer}")


def _match_paren(s: str, i: int) -> int:
    """Index of the `)` that closes a `(` just before `i`."""
    return _match_closer(s, i, "(", ")")


def _match_brace(s: str, i: int) -> int:
    """Index of the `}` that closes a `${` just before `i`."""
    return _match_closer(s, i, "{", "}")


def _skip_dq(s: str, i: int) -> int:
    """Index just after the `"` that closes a double-quoted string starting at `i` (its opening quote before)."""
    n = len(s)
    while True:
        i = _DQ_PLAIN.match(s, i).end()
        if i >= n:
            raise Unreadable("unbalanced double quote")
        c = s[i]
        if c == '"':
            return i + 1
        if c == "\\":
            i += 2
        elif c == "`":
            i = _match_backtick(s, i + 1) + 1
        elif s.startswith("$(", i):
            i = _match_paren(s, i + 2) + 1
        elif s.startswith("${", i):
            i = _match_brace(s, i + 2) + 1
        else:
            i += 1


def _match_backtick(s: str, i: int) -> int:
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            i += 2
        elif c == "`":
            return i
        else:
            i += 1
    raise Unreadable("unbalanced backtick")


_ANSI = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "v": "\v",
         "\\": "\\", "'": "'", '"': '"', "?": "?"}
_ANSI_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{1,2}|u[0-9a-fA-F]{1,4}|U[0-9a-fA-F]{1,8}|[0-7]{1,3}|c.|.)", re.DOTALL)


def _ansi_c(body: str) -> str:
    """The text of `$'...'` (bash's ANSI-C quoting)."""
    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xuU" and len(e) > 1:
            return chr(int(e[1:], 16))
        if e[0] in "01234567":
            return chr(int(e, 8) & 0xFF)
        if e[0] == "c" and len(e) == 2:
            return chr(ord(e[1]) & 0x1F)
        return _ANSI.get(e, "\\" + e)
    return _ANSI_ESCAPE.sub(one, body) if "\\" in body else body


class Lexer:
    """Tokens of a shell string: words (`Word`), control operators and redirection operators."""

    def __init__(self, s: str, compat: bool):
        self.s = s
        self.compat = compat  # read double-quoted backslashes as bashlex does (the parity tests)

    def dollar(self, i: int, value: list[str], subs: list[str], in_dq: bool) -> int:
        """`$...` at `i`: appends its text (kept as written, as bashlex does) and its substitutions."""
        s = self.s
        nxt = s[i + 1:i + 2]
        if nxt == "(":
            j = _match_paren(s, i + 2)
            inner = s[i + 2:j]
            if inner.startswith("(") and inner.endswith(")"):  # $((arithmetic))
                subs.extend(substitutions(inner[1:-1]))
            else:
                subs.append(inner)
            value.append(s[i:j + 1])
            return j + 1
        if nxt == "{":
            j = _match_brace(s, i + 2)
            inner = s[i + 2:j]
            if "$(" in inner or "`" in inner:
                subs.extend(substitutions(inner))
            value.append(s[i:j + 1])
            return j + 1
        if nxt == "'" and not in_dq:
            j = i + 2
            n = len(s)
            while j < n and s[j] != "'":
                j += 2 if s[j] == "\\" else 1
            if j >= n:
                raise Unreadable("unbalanced $' quote")
            value.append(_ansi_c(s[i + 2:j]))
            return j + 1
        if nxt == '"' and not in_dq:  # $"..." (locale translation): a double-quoted string
            return i + 1
        value.append("$")
        return i + 1

    def backtick(self, i: int, value: list[str], subs: list[str]) -> int:
        s = self.s
        j = _match_backtick(s, i + 1)
        inner = s[i + 1:j]
        if "\\" in inner:
            inner = re.sub(r"\\([\\`$])", r"\1", inner)
        subs.append(inner)
        value.append(s[i:j + 1])
        return j + 1

    def word(self, i: int) -> tuple[Word, int]:
        s, n = self.s, len(self.s)
        start = i
        value: list[str] = []
        subs: list[str] = []
        quoted = False
        while i < n:
            c = s[i]
            if c in _METACHARS:
                if c == "(" and value and ASSIGNMENT_WORD.fullmatch(s, start, i) and not quoted:  # NAME=(array)
                    j = _match_paren(s, i + 1)
                    subs.extend(substitutions(s[i + 1:j]))
                    value.append(s[i:j + 1])
                    i = j + 1
                    continue
                if c in "<>" and s.startswith("(", i + 1) and i == start:  # <(process substitution)
                    j = _match_paren(s, i + 2)
                    subs.append(s[i + 2:j])
                    value.append(s[i:j + 1])
                    i = j + 1
                    continue
                break
            if c == "'":
                j = s.find("'", i + 1)
                if j < 0:
                    raise Unreadable("unbalanced quote")
                value.append(s[i + 1:j])
                quoted = True
                i = j + 1
            elif c == '"':
                quoted = True
                i = self.dq(i + 1, value, subs)
            elif c == "\\":
                if i + 1 >= n:
                    value.append("\\")  # a trailing backslash is literal
                    i += 1
                elif s[i + 1] == "\n":
                    i += 2
                else:
                    value.append(s[i + 1])
                    quoted = True
                    i += 2
            elif c == "$":
                if s.startswith("$'", i) or s.startswith('$"', i):
                    quoted = True
                i = self.dollar(i, value, subs, False)
            elif c == "`":
                i = self.backtick(i, value, subs)
            else:
                m = _PLAIN.match(s, i)
                value.append(m.group())
                i = m.end()
        return Word("".join(value), s[start:i], subs, quoted), i

    def dq(self, i: int, value: list[str], subs: list[str]) -> int:
        s, n = self.s, len(self.s)
        while True:
            m = _DQ_PLAIN.match(s, i)
            if m.end() > i:
                value.append(m.group())
                i = m.end()
            if i >= n:
                raise Unreadable("unbalanced double quote")
            c = s[i]
            if c == '"':
                return i + 1
            if c == "\\":
                nxt = s[i + 1:i + 2]
                if nxt == "\n":
                    pass
                elif nxt in ('$', '`', '"', '\\') or self.compat:
                    value.append(nxt)
                else:
                    value.append("\\" + nxt)
                i += 2
            elif c == "$":
                i = self.dollar(i, value, subs, True)
            else:
                i = self.backtick(i, value, subs)

    def tokens(self) -> list:
        """[("w", Word) | ("op", text) | ("r", operator) | ("arith", text)]"""
        s, n = self.s, len(self.s)
        out: list = []
        i = 0
        while i < n:
            c = s[i]
            if c in " \t":
                i += 1
            elif c == "\\" and s.startswith("\n", i + 1):
                i += 2
            elif c == "#":
                j = s.find("\n", i)
                i = n if j < 0 else j
            elif c == "\n" or c == ";" or c == ")":
                if c == ";" and s.startswith(";;", i):
                    op = ";;&" if s.startswith(";;&", i) else ";;"
                elif c == ";" and s.startswith(";&", i):
                    op = ";&"
                else:
                    op = c
                out.append(("op", op))
                i += len(op)
            elif c == "&":
                if s.startswith("&>>", i):
                    out.append(("r", "&>>"))
                    i += 3
                elif s.startswith("&>", i):
                    out.append(("r", "&>"))
                    i += 2
                elif s.startswith("&&", i):
                    out.append(("op", "&&"))
                    i += 2
                else:
                    out.append(("op", "&"))
                    i += 1
            elif c == "|":
                op = "||" if s.startswith("||", i) else "|&" if s.startswith("|&", i) else "|"
                out.append(("op", op))
                i += len(op)
            elif c == "(":
                if s.startswith("((", i) and self._command_position(out):
                    j = _match_paren(s, i + 1)
                    inner = s[i + 1:j]
                    if inner.startswith("(") and inner.endswith(")"):  # ((arithmetic))
                        out.append(("arith", inner[1:-1]))
                        i = j + 1
                        continue
                out.append(("op", "("))
                i += 1
            elif c in "<>" and not s.startswith("(", i + 1):
                m = _REDIRECT.match(s, i)
                out.append(("r", m.group()))
                i = m.end()
            elif c.isdigit() and (m := _IO_NUMBER.match(s, i)) and not s.startswith("(", m.end() + 1):
                i = m.end()  # the descriptor of a redirection: dropped, as _parse_bashlex does
            else:
                w, i = self.word(i)
                out.append(("w", w))
        return out

    @staticmethod
    def _command_position(out: list) -> bool:
        if not out:
            return True
        kind, value = out[-1]
        if kind == "op":
            return value != ")"
        return kind == "w" and not value.quoted and value.value in ("do", "then", "else", "!", "{", "if", "while",
                                                                     "until", "elif", "for")


def substitutions(text: str) -> list[str]:
    """The `$(...)` and backtick bodies inside a piece of text that is not read as words (`${...}`, arrays,
    arithmetic), for a superset of bashlex's reading."""
    subs: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            i = n if j < 0 else j + 1
        elif c == "`":
            j = _match_backtick(text, i + 1)
            subs.append(text[i + 1:j])
            i = j + 1
        elif c == "$" and text.startswith("$(", i):
            j = _match_paren(text, i + 2)
            inner = text[i + 2:j]
            if inner.startswith("(") and inner.endswith(")"):
                subs.extend(substitutions(inner[1:-1]))
            else:
                subs.append(inner)
            i = j + 1
        else:
            i += 1
    return subs
