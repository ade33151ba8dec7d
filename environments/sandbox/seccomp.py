"""The bwrap sandbox's seccomp filter: no new namespaces, no kernel interfaces a coding task never needs.

bwrap's own options stop at the namespaces it makes; what runs inside may still make more. As root the sandbox
starts without a user namespace of its own, so `unshare -U` / `unshare -r` (or `clone(CLONE_NEWUSER)`) would hand
the agent a namespace in which it is root: the first step of many container escapes and a large kernel attack
surface. The filter below, loaded by bwrap (`--seccomp FD`) just before the command runs and inherited by every
process inside, refuses with EPERM:

- `unshare` and `clone` with any namespace flag (user, mount, pid, net, ipc, uts, cgroup, time);
- `setns`, `keyctl`/`add_key`/`request_key`, `bpf`, `perf_event_open`, `userfaultfd`;
- every x32-ABI call (a second syscall table the rules above would not see);

and answers `clone3` with ENOSYS, as Docker's profile does: its flags sit in memory a filter cannot read, and
glibc falls back to `clone`, whose flags it can. `ptrace` stays allowed: the PID namespace already confines it to
the sandbox's own processes (debuggers and `strace` keep working). Anything else is allowed.

The program is classic BPF, assembled here (no libseccomp): x86_64 and aarch64; on another architecture there is
no filter (`program()` returns None) and the sandbox says so once.
"""

from __future__ import annotations

import errno
import os
import platform
import struct
from functools import lru_cache

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_KILL_PROCESS = 0x80000000
_X32_BIT = 0x40000000

_CLONE_NEW = {"NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000, "NEWIPC": 0x08000000,
              "NEWUSER": 0x10000000, "NEWPID": 0x20000000, "NEWNET": 0x40000000}
CLONE_NS_MASK = sum(_CLONE_NEW.values())
UNSHARE_NS_MASK = CLONE_NS_MASK | 0x80  # CLONE_NEWTIME: in clone()'s flags that bit is the exit signal's

# (audit arch, syscall numbers) per machine
_TABLES = {
    "x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "setns": 308, "keyctl": 250, "add_key": 248,
                            "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323}),
    "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "setns": 268, "keyctl": 219, "add_key": 217,
                             "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282}),
}
REFUSED = ("setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd")


def _assemble(lines: list) -> bytes:
    """(code, jt, jf, k) with jt/jf as label names (or 0), and label strings marking positions → sock_filter[]."""
    labels, out, pos = {}, [], 0
    for line in lines:
        if isinstance(line, str):
            labels[line] = pos
        else:
            pos += 1
    pos = 0
    for line in lines:
        if isinstance(line, str):
            continue
        code, jt, jf, k = line
        rel = [labels[j] - pos - 1 if isinstance(j, str) else j for j in (jt, jf)]
        out.append(struct.pack("=HBBI", code, rel[0], rel[1], k))
        pos += 1
    return b"".join(out)


def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one) as bwrap reads it, or None where there is no table."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        return None
    arch, nr = _TABLES[machine]
    deny = _ERRNO | errno.EPERM
    lines = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 0, "kill", arch),
             (_LD_W_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        lines.append((_JGE_K, "deny", 0, _X32_BIT))
    lines += [(_JEQ_K, "deny", 0, nr[name]) for name in REFUSED]
    lines += [(_JEQ_K, "enosys", 0, nr["clone3"]), (_JEQ_K, "unshare", 0, nr["unshare"]),
              (_JEQ_K, "clone", 0, nr["clone"]), (_RET_K, 0, 0, _ALLOW),
              "unshare", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET_K, "deny", 0, UNSHARE_NS_MASK), (_RET_K, 0, 0, _ALLOW),
              "clone", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET_K, "deny", 0, CLONE_NS_MASK), (_RET_K, 0, 0, _ALLOW),
              "deny", (_RET_K, 0, 0, deny),
              "enosys", (_RET_K, 0, 0, _ERRNO | errno.ENOSYS),
              "kill", (_RET_K, 0, 0, _KILL_PROCESS)]  # another ABI than the table's: nothing to run here
    return _assemble(lines)


@lru_cache(maxsize=1)
def _this_machine() -> bytes | None:
    return program()


def open_program() -> int | None:
    """A pipe holding the filter, its read end for one bwrap (`--seccomp FD` reads it to the end; the caller
    closes it once bwrap has started), or None on a machine without a table."""
    code = _this_machine()
    if code is None:
        return None
    read, write = os.pipe()
    os.write(write, code)  # a few hundred bytes: well inside a pipe's buffer
    os.close(write)
    return read
