"""What the shell parser (antihack/shell.py) and the shell reader (antihack/shell_reader.py) share: the parsed
command and the variable pattern. Its own module, so that neither of the two imports the other's half."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PYTHONS = ("python", "python3", "python2", "pypy", "pypy3")
VAR_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


@dataclass
class ShellCommand:
    argv: list[str]
    redirects: list[tuple[str, str]] = field(default_factory=list)  # (operator, target)
    python_code: list[str] = field(default_factory=list)  # bodies of python -c and python heredocs
    stdin_script: str = ""  # a heredoc or here-string body

    @property
    def name(self) -> str:
        return self.argv[0].rsplit("/", 1)[-1] if self.argv else ""

    @property
    def is_python(self) -> bool:
        return self.name.startswith(_PYTHONS)
