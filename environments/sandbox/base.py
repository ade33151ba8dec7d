"""What every sandbox backend shares: the limits, the contract (`Sandbox`), the host folder sandboxes live in,
the unprivileged uid each sandbox leases, and the size-capped tmpfs its workspace is."""

from __future__ import annotations

import ctypes
import fcntl
import os
from dataclasses import dataclass, fields
from pathlib import Path

from environments.types import ExecResult

SANDBOX_ROOT = Path(os.environ.get("RL_SANDBOX_ROOT", "/tmp/agentic-rl-sandboxes"))
UID_RANGE = range(61000, 62000)


@dataclass
class SandboxLimits:
    timeout_s: float = 30.0  # default wall time per exec
    memory_mb: int = 1024  # RLIMIT_AS per process
    cpu_s: int = 60  # RLIMIT_CPU per process
    max_processes: int = 64  # RLIMIT_NPROC for the sandbox's uid
    max_file_mb: int = 16  # RLIMIT_FSIZE
    max_open_files: int = 256
    max_output_bytes: int = 64_000  # stdout/stderr kept per exec (head + tail)

    @classmethod
    def from_kwargs(cls, **limits) -> "SandboxLimits":
        known = {f.name for f in fields(cls)}
        unknown = set(limits) - known
        if unknown:
            raise TypeError(f"unknown sandbox limits {sorted(unknown)}; known: {sorted(known)}")
        return cls(**limits)


class Sandbox:
    """Contract shared by all backends. Usable as a context manager."""

    workspace: Path  # host path of the workspace (visible as /workspace inside)

    def exec(self, cmd: str | list[str], timeout: float | None = None, stdin: str | None = None) -> ExecResult:
        raise NotImplementedError

    def write_file(self, path: str, content: str) -> None:
        """Written from inside the sandbox, so a symlink planted by the agent cannot redirect it outside."""
        result = self.exec(["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path],
                           stdin=content)
        if result.exit_code != 0:
            raise OSError(f"write_file {path}: {result.stderr.strip() or result.exit_code}")

    def read_file(self, path: str) -> str:
        result = self.exec(["/bin/cat", "--", path])
        if result.exit_code != 0:
            raise FileNotFoundError(f"read_file {path}: {result.stderr.strip()}")
        return result.stdout

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc: mount(2), umount2(2)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def mount_tmpfs(target: Path, size_mb: int, uid: int) -> None:
    """A size-capped tmpfs at `target` on the host, owned by `uid`: the workspace's disk quota (needs root)."""
    opts = f"size={size_mb}m,mode=0755,uid={uid},gid={uid}".encode()
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount the workspace tmpfs at {target}: {os.strerror(err)} (needs root)")


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(err, f"cannot unmount {target}: {os.strerror(err)}")


class UidLease:
    """An unprivileged uid reserved for one sandbox, across processes (a lock file per uid)."""

    def __init__(self):
        lock_dir = SANDBOX_ROOT / ".uids"
        lock_dir.mkdir(parents=True, exist_ok=True)
        start = os.getpid() % len(UID_RANGE)
        for i in range(len(UID_RANGE)):
            uid = UID_RANGE[(start + i) % len(UID_RANGE)]
            handle = open(lock_dir / str(uid), "w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.uid, self._handle = uid, handle
            return
        raise RuntimeError(f"all {len(UID_RANGE)} sandbox uids are in use")

    def release(self):
        self._handle.close()
