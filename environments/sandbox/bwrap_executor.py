"""The bubblewrap sandbox's resident executor: runs inside the sandbox, one command per request from the host.

Started once per sandbox by `BwrapSandbox` (as root only), so that a tool call costs a fork and an exec instead of
a new bwrap, new namespaces, /proc and /dev mounts and two helper execs (~17 ms → a few ms, docs/BENCHMARKS.md).
Mounted read-only at /.sandbox-executor (the project is not mounted inside) and run by `python -I -S`: it
imports nothing but the standard library.

Who is who: the executor runs as root inside the sandbox's PID, network, IPC and UTS namespaces with only
CAP_SETUID, CAP_SETGID, CAP_KILL and CAP_SETPCAP (to empty the commands' bounding set). Each command runs as
the sandbox's unprivileged uid, in a new session, with the rlimits, no supplementary groups, no capabilities and
no_new_privs, so the agent's processes can neither signal nor trace the executor nor read its pipes. It talks
only to the host, over its stdin/stdout (one JSON line each way); the command's stdin, stdout and stderr are
files in a root-only folder (`io`) the host reads.

Per call, as before with one bwrap per call: when the command ends or times out, every process of the sandbox's
uid is killed (`kill(-1)` from here reaches all of them and nothing else: bwrap's init is exempt), so orphans
and daemons never outlive the call that started them. The sandbox's /tmp now lives as long as the sandbox.

Protocol: request `{"argv": [...], "timeout": seconds, "stdin": bool}`; reply `{"status": wait status or null,
"timed_out": bool}`. The host kills the whole sandbox if no reply comes in time.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
RLIMITS = {"as": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE,
           "nproc": resource.RLIMIT_NPROC, "nofile": resource.RLIMIT_NOFILE}


def kill_all(deadline_s: float = 3.0) -> None:
    """SIGKILL every process this one may signal (the sandbox uid's), until none is left to signal. The killed
    become zombies for a moment, reaped by bwrap's init; a fork bomb may fork between two rounds."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.001)


def run(request: dict, uid: int, limits: dict, io: str, prctl, control: int) -> dict:
    argv = request["argv"]
    fds = [os.open(f"{io}/stdin" if request.get("stdin") else "/dev/null", os.O_RDONLY),
           os.open(f"{io}/stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600),
           os.open(f"{io}/stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)]
    pid = os.fork()
    if pid == 0:  # the command: its own session, limits, then the uid; nothing of the executor's is inherited
        try:
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.closerange(3, 65536)
            for name, value in limits.items():
                resource.setrlimit(RLIMITS[name], (value, value))
            for cap in range(64):  # an empty bounding set: nothing can be regained, whatever it executes
                prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # (EINVAL past the kernel's last capability: ignored)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # drops every capability
            if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")
            os.chdir("/workspace")
            os.execvp(argv[0], argv)
        except BaseException as exc:  # noqa: BLE001 - report anything, never return into the executor's loop
            os.write(2, f"sandbox: cannot run {argv[0]!r}: {exc}\n".encode())
        os._exit(127)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    # The host sends nothing while a call runs: the control pipe turning readable means it closed (the host is
    # gone), and the call ends now rather than at its timeout.
    ready = select.select([pidfd, control], [], [], max(float(request["timeout"]), 0.0))[0]
    os.close(pidfd)
    host_gone = control in ready
    timed_out = not ready
    if timed_out or host_gone:
        os.kill(-1, signal.SIGKILL)  # the command and all it started; then reap the command before counting
    _, status = os.waitpid(pid, 0)
    kill_all()  # orphans and daemons of this call (a zombie still counts as signalable until init reaps it)
    if host_gone:
        sys.exit(0)
    return {"status": status, "timed_out": timed_out}


def main() -> None:
    config = json.loads(sys.argv[1])
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    control_in, control_out = sys.stdin.buffer, sys.stdout
    control_out.write('{"ready": true}\n')
    control_out.flush()
    for line in control_in:
        reply = run(json.loads(line), config["uid"], config["limits"], config["io"], prctl, control_in.fileno())
        control_out.write(json.dumps(reply) + "\n")
        control_out.flush()
    kill_all()


if __name__ == "__main__":
    main()
