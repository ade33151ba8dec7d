r"""Our own reader for the bash that agents write: the simple commands of a shell string, as the rules see them.

It produces what `antihack.shell._parse_bashlex` makes of bashlex's tree (same commands in the same order, same
argv, same redirections), in a few tens of µs instead of bashlex's ~1.5 ms, and without importing bashlex (a
150 ms first call). What it reads:

- words: single and double quotes, backslash escapes, line continuations, `$'...'` (decoded), `$(...)`,
  backticks, `${...}`, `$((...))`, `<(...)` / `>(...)` (substitutions are read recursively, their commands
  come before the command that holds them, as bashlex's visit does); comments;
- lists and pipelines: `;` `&` `&&` `||` `|` `|&` and newlines; `!`;
- redirections `>` `>>` `<` `<>` `>|` `&>` `&>>` `>&` `<&` `<<<` with an optional descriptor (dropped, as
  `_parse_bashlex` does: `2>&1` is `(">", "&1")`); here-documents arrive lifted (`antihack.shell._lift_heredocs`)
  as here-strings;
- `NAME=value` prefixes (kept in the variable table, not in argv), arrays `NAME=(...)`;
- `( ... )`, `{ ...; }`, `if/then/elif/else/fi`, `while/until ... do ... done`, `for/select NAME in ...; do ...
  done` (the loop variable expands to the joined words, as in `_parse_bashlex`), `for ((...))`, `case ... esac`,
  functions (`f() {...}`, `function f {...}`), `[[ ... ]]` (one command `[[ ... ]]`), `(( ... ))` (no command).

Intentional differences from bashlex, all towards bash itself or towards reading more (never fewer commands or
paths; tests/antihack/test_shell_reader.py lists them):

- a backslash inside double quotes is kept unless it escapes $, `, ", \ or a newline (bashlex drops it: it
  reads `"a\nb"` as `anb`, bash passes `a\nb`); `'it''s'` is `its` (bashlex keeps the inner quotes); `$'\x72m'`
  is decoded (`rm`);
- redirections of a compound command (`{ ...; } > f`, `while ...; done < f`, `( ... ) 2>/dev/null`) are
  attached to every command inside it (bashlex's tree keeps them on the compound, where `_parse_bashlex` never
  looks);
- substitutions in redirection targets, here-strings and `${...}` are read too (`> $(cmd)`, `<<< "$(cmd)"`);
- what bashlex rejects but bash runs (`case`, `[[ ]]`, arrays, arithmetic, `time`, `select`) is read as
  structure, where the token fallback of `antihack.shell` only split words on operators.

`read_shell` returns None for what it does not understand (unbalanced quotes or parentheses, a here-document
operator that was not lifted, stray closers, unterminated compounds): the caller then falls back to bashlex.
"""

from __future__ import annotations

from antihack.shell_lexer import ASSIGNMENT_WORD, Lexer, Unreadable, Word, substitutions
from antihack.shell_types import VAR_REF, ShellCommand

_OPENERS = {"if", "while", "until", "for", "select", "case", "{"}
_CLOSERS = {"fi": "if", "done": "loop", "esac": "case", "}": "{"}
_CONTINUE = {"then", "else", "elif", "do", "!"}  # reserved words after which a command starts again
_LOOPS = {"while", "until", "for", "select"}
_SEPARATORS = {";", "&", "&&", "||", "|", "|&", "\n"}
_CASE_ENDS = {";;", ";&", ";;&"}


# ---- reading the command structure -------------------------------------------------------------------------
class _Reader:
    def __init__(self, compat: bool):
        self.compat = compat
        self.out: list[ShellCommand] = []
        self.env: dict[str, str] = {}

    def expand(self, word: str) -> str:
        if "$" not in word:
            return word
        env = self.env
        return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), word)

    def subs(self, word: Word) -> None:
        for text in word.subs:
            self.read(text)

    def read(self, text: str) -> None:
        toks = Lexer(text, self.compat).tokens()
        out = self.out
        cur: ShellCommand | None = None
        start = True  # command position: reserved words count
        stack: list[list] = []  # open compounds: [kind, index of their first command in out, case mode]
        closed: int | None = None  # just after a compound's closer: its first command (for its redirections)
        i, n = 0, len(toks)

        def finish() -> None:
            nonlocal cur
            if cur is not None:
                out.append(cur)
                cur = None

        while i < n:
            kind, tok = toks[i]
            i += 1
            if kind == "op":
                case_top = stack[-1] if stack and stack[-1][0] == "case" else None
                if case_top is not None and case_top[2] == "pattern":
                    if tok == ")":
                        case_top[2] = "body"
                        start = True
                    continue  # `(` and `|` of the patterns
                if tok in _SEPARATORS:
                    finish()
                    start, closed = True, None
                elif tok in _CASE_ENDS:
                    finish()
                    if case_top is None:
                        raise Unreadable(f"{tok} outside case")
                    case_top[2] = "pattern"
                    start, closed = True, None
                elif tok == "(":
                    if cur is not None and len(cur.argv) == 1 and not cur.redirects and i < n and \
                            toks[i] == ("op", ")"):  # name() compound: a function definition
                        cur = None
                        i += 1
                        start = True
                        continue
                    if cur is not None or closed is not None:
                        raise Unreadable("unexpected (")
                    stack.append(["(", len(out), None])
                    start = True
                else:  # ")"
                    finish()
                    if not stack or stack[-1][0] != "(":
                        raise Unreadable("unexpected )")
                    closed = stack.pop()[1]
                    start = False
                continue
            if kind == "arith":
                if cur is not None:
                    raise Unreadable("arithmetic after words")
                for sub in substitutions(tok):
                    self.read(sub)
                start = True  # `for ((...))` goes on with `do`; `(( ... ))` alone is a complete command
                continue
            if kind == "r":
                if i >= n or toks[i][0] != "w":
                    raise Unreadable("redirection without a target")
                target: Word = toks[i][1]
                i += 1
                if tok in ("<<", "<<-"):
                    raise Unreadable("here-document that was not lifted")
                text_ = self.expand(target.value)
                op = tok
                if op in (">&", "<&"):
                    if text_.isdigit() or text_ == "-":
                        text_ = "&" + text_
                    op = op[0]
                self.subs(target)
                if cur is None and closed is not None:  # { ...; } > f: every command inside writes there
                    for cmd in out[closed:]:
                        cmd.redirects.append((op, text_))
                        if op == "<<<":
                            cmd.stdin_script = text_
                    continue
                if cur is None:
                    cur = ShellCommand([])
                cur.redirects.append((op, text_))
                if op == "<<<":
                    cur.stdin_script = text_
                start = False
                continue
            # a word
            word: Word = tok
            top = stack[-1] if stack else None
            if top is not None and top[2] == "pattern":  # case patterns, up to `)`; or the end of the case
                if word.value == "esac" and not word.quoted:
                    closed = stack.pop()[1]
                    start = False
                continue
            if cur is None and not word.quoted and (start or closed is not None):
                value = word.value
                if value in _CLOSERS:
                    expected = _CLOSERS[value]
                    if top is None or (top[0] != expected and not (expected == "loop" and top[0] in _LOOPS)):
                        raise Unreadable(f"unexpected {value}")
                    closed = stack.pop()[1]
                    start = False
                    continue
                if value in _CONTINUE:
                    start, closed = True, None
                    continue
                if closed is not None:
                    raise Unreadable("words after a compound command")
                if value in ("if", "while", "until", "{"):
                    stack.append([value, len(out), None])
                    continue
                if value in ("for", "select"):
                    stack.append([value, len(out), None])
                    i = self._loop_header(toks, i)
                    continue
                if value == "case":
                    i = self._case_header(toks, i)
                    stack.append(["case", len(out), "pattern"])
                    continue
                if value == "function":
                    if i < n and toks[i][0] == "w":
                        i += 1
                        if i + 1 < n and toks[i] == ("op", "(") and toks[i + 1] == ("op", ")"):
                            i += 2
                    continue
                if value == "[[":
                    i = self._double_bracket(toks, i)
                    start = False
                    continue
            elif closed is not None:
                raise Unreadable("words after a compound command")
            start = False
            if cur is None:
                cur = ShellCommand([])
            if not cur.argv and ASSIGNMENT_WORD.match(word.raw):  # NAME=value before the command name
                name, _, value = word.value.partition("=")
                self.env[name.rstrip("+")] = self.expand(value)
                self.subs(word)
                continue
            cur.argv.append(self.expand(word.value))
            self.subs(word)
        finish()
        if stack:
            raise Unreadable(f"unterminated {stack[-1][0]}")

    def _loop_header(self, toks: list, i: int) -> int:
        """`for NAME [in WORDS]` up to the separator before `do` (or `for ((...))`): sets the loop variable."""
        n = len(toks)
        if i < n and toks[i][0] == "arith":
            return i  # the main loop skips it
        if i >= n or toks[i][0] != "w":
            raise Unreadable("for without a name")
        words = [toks[i][1]]
        i += 1
        while i < n and toks[i] == ("op", "\n"):
            i += 1
        if i < n and toks[i][0] == "w" and toks[i][1].value == "in" and not toks[i][1].quoted:
            i += 1
            while i < n and toks[i][0] == "w":
                words.append(toks[i][1])
                i += 1
        if len(words) >= 2:
            self.env[words[0].value] = " ".join(self.expand(w.value) for w in words[1:])
        for w in words[1:]:
            self.subs(w)
        return i

    def _case_header(self, toks: list, i: int) -> int:
        """`case WORD in`: the word's substitutions run."""
        n = len(toks)
        if i + 1 >= n or toks[i][0] != "w":
            raise Unreadable("case without a word")
        self.subs(toks[i][1])
        i += 1
        while i < n and toks[i] == ("op", "\n"):
            i += 1
        if i >= n or toks[i][0] != "w" or toks[i][1].value != "in":
            raise Unreadable("case without in")
        return i + 1

    def _double_bracket(self, toks: list, i: int) -> int:
        """`[[ ... ]]`: one command, operators inside it are words."""
        cmd = ShellCommand(["[["])
        n = len(toks)
        while i < n:
            kind, tok = toks[i]
            i += 1
            if kind == "w":
                cmd.argv.append(self.expand(tok.value))
                self.subs(tok)
                if tok.value == "]]" and not tok.quoted:
                    break
            elif kind in ("op", "r") and tok != "\n":
                cmd.argv.append(tok)
            elif kind == "arith":
                cmd.argv.append(f"(({tok}))")
        else:
            raise Unreadable("unterminated [[")
        self.out.append(cmd)
        return i


def read_shell(text: str, compat: bool = False) -> list[ShellCommand] | None:
    """The simple commands of `text` (here-documents already lifted), or None where this reader gives up.
    `compat` reads double-quoted backslashes as bashlex does (for the parity tests only)."""
    reader = _Reader(compat)
    try:
        reader.read(text)
    except (Unreadable, RecursionError):
        return None
    return reader.out
