"""The Docker backend of `make_sandbox`: one container per sandbox, the same contract as bubblewrap.

A sandbox is a container started (on its first `exec`) from a locally built image (launch/docker/build_image.sh;
a task may name its own in its metadata, `docker_image`) with:

- `--network none`, a read-only root filesystem, every capability dropped, `no-new-privileges`, Docker's default
  seccomp profile, and `docker-init` as PID 1 (it reaps orphans);
- cgroup limits on memory (swap off: memory+swap = memory), process count and CPU share, and rlimits on file
  size, open files and CPU seconds inherited by every process;
- PID 1 runs as `nobody` and every command as an unprivileged uid of its own (leased like bwrap's), so agent code
  cannot signal PID 1, and sandboxes never share a uid;
- a private, size-capped tmpfs at /tmp (and a small /dev/shm);
- the workspace: a **size-capped tmpfs mounted on the host** (`workspace_mb`) and bind-mounted at /workspace.
  A tmpfs, not a volume with a quota: overlay2's `--storage-opt size` and volume quotas need XFS project
  quotas, and our machines' data roots are ext4; a tmpfs caps the size on any filesystem, lives in RAM (charged
  to the container's memory cgroup when agent code writes it; `workspace_mb` ≤ `memory_mb` keeps it inside the
  container's budget) and is gone at unmount. Mounted by us on the host, not by Docker (a `--tmpfs` mount or a
  tmpfs-type volume exists only while the container runs), because the framework writes the task files into
  `sandbox.workspace` before the first command and reads the agent's files from it after the last
  (`setup_workspace`, `collect_files`), and the grader binds a report folder next to it, all from the host
  side, as with bubblewrap. That needs root on the engine's host.

Every `exec` is one `docker exec` of `sh -c '"$@"; kill -9 -1'`: when the command returns, everything else the
call started (background jobs, daemons, orphans) is killed, so, as with bubblewrap, nothing a call starts
outlives it, and a daemon holding stdout cannot keep the call open. A timeout kills every process of the
sandbox's uid (or restarts the container when even that cannot start, e.g. under a fork bomb). Calls into one
sandbox are serialised. `close()` removes the container (SIGKILL to everything in its cgroup), unmounts the
workspace and removes its folder.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

from environments.sandbox.base import SANDBOX_ROOT, Sandbox, SandboxLimits, UidLease
from environments.sandbox.base import mount_tmpfs as _mount_tmpfs
from environments.sandbox.base import unmount as _unmount
from environments.types import ExecResult

DEFAULT_IMAGE = os.environ.get("RL_SANDBOX_IMAGE", "agentic-rl/python:bookworm")
LABEL = "org.agentic-rl.sandbox"
NOBODY = 65534
BUILD_HINT = "build it with launch/docker/build_image.sh"
# After the command: kill everything else of this uid (PID 1 runs as another uid; `kill` is a builtin, so it
# needs no new process even when the pids cgroup is full). Repeated until nothing is left (a fork bomb refills).
_WRAPPER = '"$@"; rc=$?; n=0; while kill -9 -1 2>/dev/null && [ $n -lt 200 ]; do n=$((n+1)); done; exit $rc'
EXEC_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
            # third-party pytest plugins are not the task's (and cost time at every run), as with bwrap
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
_KILL_ALL = 'n=0; while kill -9 -1 2>/dev/null && [ $n -lt 200 ]; do n=$((n+1)); done; exit 0'


@dataclass
class DockerOptions:
    """What only the Docker backend takes, next to `SandboxLimits`."""

    image: str = DEFAULT_IMAGE
    cpus: float = 1.0  # CPU share (cgroup quota), in cores
    workspace_mb: int = 256  # size of the workspace tmpfs
    tmp_mb: int = 64  # size of /tmp (a tmpfs; /dev/shm gets 16 MB)

    def __post_init__(self):
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError(f"docker image must be a non-empty name, got {self.image!r}")
        if not self.cpus > 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus!r}")
        for name in ("workspace_mb", "tmp_mb"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive number of MB, got {getattr(self, name)!r}")


DOCKER_OPTIONS = tuple(f.name for f in fields(DockerOptions))

_clients: dict[str, object] = {}
_clients_lock = threading.Lock()


def docker_client():
    """One SDK client per engine address (DOCKER_HOST, else the default socket), shared by every sandbox of the
    process; its connection pool is sized for hundreds of concurrent sandboxes."""
    try:
        import docker
    except ImportError as exc:
        raise RuntimeError("the docker backend needs the `docker` package (pip install docker)") from exc
    key = os.environ.get("DOCKER_HOST", "")
    with _clients_lock:
        if key not in _clients:
            try:
                client = docker.from_env(max_pool_size=512, timeout=60)
                client.ping()
            except Exception as exc:
                where = key or "the default socket (unix:///var/run/docker.sock)"
                raise RuntimeError(f"no Docker engine answers at {where}: {exc}. Start one (see "
                                   "launch/docker/start_engine.sh) and set DOCKER_HOST") from exc
            _clients[key] = client
        return _clients[key]


def docker_available(image: str = DEFAULT_IMAGE) -> tuple[bool, str]:
    """(True, engine description) when a Docker sandbox can start here; else (False, why not)."""
    try:
        client = docker_client()
    except RuntimeError as exc:
        return False, str(exc)
    try:
        client.images.get(image)
    except Exception as exc:
        return False, f"the Docker engine has no image {image!r} ({type(exc).__name__}); {BUILD_HINT}"
    if os.geteuid() != 0:
        return False, "the docker backend mounts a size-capped tmpfs workspace on the host and needs root"
    version = client.version().get("Version", "?")
    return True, f"Docker {version} at {os.environ.get('DOCKER_HOST') or 'the default socket'}"


# ---- output ---------------------------------------------------------------------------------------------------
class _Capped:
    """Head and tail of a stream, at most `cap` bytes kept, with a note of what was cut (as bwrap's capture)."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.half:
                del self.tail[:len(self.tail) - self.half]

    def text(self) -> tuple[str, bool]:
        if self.size <= self.cap:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace"), False
        tail = bytes(self.tail[-self.half:])
        note = f"\n[... {self.size - len(self.head) - len(tail)} bytes of output omitted ...]\n".encode()
        return (bytes(self.head) + note + tail).decode("utf-8", "replace"), True


class _Demux:
    """Docker's multiplexed exec stream (8-byte frame headers: stream id, 3 zero bytes, big-endian length)."""

    def __init__(self, out: _Capped, err: _Capped):
        self.targets = {1: out, 2: err}
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 8:
            stream, length = self.buf[0], struct.unpack(">I", self.buf[4:8])[0]
            if len(self.buf) < 8 + length:
                return
            target = self.targets.get(stream)
            if target is not None:
                target.add(bytes(self.buf[8:8 + length]))
            del self.buf[:8 + length]


def _raw_socket(sock):
    return getattr(sock, "_sock", sock)


class DockerSandbox(Sandbox):
    def __init__(self, limits: SandboxLimits | None = None, options: DockerOptions | None = None):
        self.limits = limits or SandboxLimits()
        self.options = options or DockerOptions()
        if os.geteuid() != 0:
            raise RuntimeError("the docker backend mounts a size-capped tmpfs workspace on the host and needs root")
        self._client = docker_client()
        try:
            self._client.images.get(self.options.image)
        except Exception as exc:
            raise RuntimeError(f"the Docker engine has no image {self.options.image!r}; {BUILD_HINT} "
                               f"({type(exc).__name__})") from exc
        self._closed = False
        self._lock = threading.Lock()
        self.container = None
        self.extra_binds: list[tuple[Path, str, bool]] = []
        SANDBOX_ROOT.mkdir(parents=True, exist_ok=True)
        self._lease = UidLease()
        self._root = Path(tempfile.mkdtemp(prefix="dkr-", dir=SANDBOX_ROOT))
        self.workspace = self._root / "workspace"
        self.workspace.mkdir()
        try:
            _mount_tmpfs(self.workspace, self.options.workspace_mb, self._lease.uid)
        except OSError:
            self._lease.release()
            shutil.rmtree(self._root, ignore_errors=True)
            raise

    @property
    def uid(self) -> int:
        return self._lease.uid

    @property
    def started(self) -> bool:
        return self.container is not None

    def bind(self, host: Path, inside: str, writable: bool = False) -> None:
        """Expose another host folder at `inside`; only before the first command (the container starts then)."""
        if self.container is not None:
            raise RuntimeError("bind() must come before the first exec: the container has started")
        if writable:
            os.chown(host, self.uid, self.uid)
        self.extra_binds.append((Path(host), inside, writable))

    # ---- container ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        from docker.types import Mount, Ulimit

        lim, opt = self.limits, self.options
        mb = 1024 * 1024
        mounts = [Mount("/workspace", str(self.workspace), type="bind", read_only=False)]
        mounts += [Mount(inside, str(host), type="bind", read_only=not writable)
                   for host, inside, writable in self.extra_binds]
        self.container = self._client.containers.run(
            opt.image, ["sleep", "infinity"], detach=True, init=True, user=f"{NOBODY}:{NOBODY}",
            network_mode="none", read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
            mem_limit=lim.memory_mb * mb, memswap_limit=lim.memory_mb * mb, pids_limit=lim.max_processes + 2,
            nano_cpus=int(opt.cpus * 1e9), shm_size=16 * mb, ipc_mode="private",
            tmpfs={"/tmp": f"size={opt.tmp_mb}m,mode=1777,nosuid,nodev"},
            ulimits=[Ulimit(name="fsize", soft=lim.max_file_mb * mb, hard=lim.max_file_mb * mb),
                     Ulimit(name="nofile", soft=lim.max_open_files, hard=lim.max_open_files),
                     Ulimit(name="cpu", soft=lim.cpu_s, hard=lim.cpu_s),
                     Ulimit(name="core", soft=0, hard=0)],
            mounts=mounts, working_dir="/workspace", hostname="sandbox", auto_remove=False,
            environment={"HOME": "/workspace", "LANG": "C.UTF-8"},
            labels={LABEL: "1", f"{LABEL}.owner": f"{socket.gethostname()}:{os.getpid()}"})

    def _kill_all(self) -> None:
        """Kill every process of the sandbox's uid; restart the container when not even that can start."""
        try:
            self._client.api.exec_start(self._client.api.exec_create(
                self.container.id, ["/bin/sh", "-c", _KILL_ALL], user=f"{self.uid}:{self.uid}")["Id"])
            return
        except Exception:
            pass
        self.container.restart(timeout=0)  # SIGKILL to the whole cgroup; the workspace (a host tmpfs) stays

    # ---- contract -------------------------------------------------------------------------------------------
    def exec(self, cmd: str | list[str], timeout: float | None = None, stdin: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox is closed")
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("exec: cmd must be a string or a non-empty list of strings")
        timeout = self.limits.timeout_s if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox is closed")
            if self.container is None:
                self._start()
            return self._exec(argv, timeout, stdin)

    def _exec(self, argv: list[str], timeout: float, stdin: str | None) -> ExecResult:
        import docker.errors

        api = self._client.api
        started = time.perf_counter()
        deadline = started + timeout
        spec = dict(cmd=["/bin/sh", "-c", _WRAPPER, "sandbox", *argv], stdin=stdin is not None,
                    user=f"{self.uid}:{self.uid}", workdir="/workspace", environment=EXEC_ENV)
        try:
            exec_id = api.exec_create(self.container.id, **spec)["Id"]
        except docker.errors.APIError as exc:
            if "is not running" not in str(exc):
                raise
            self.container.start()  # its init died (the OOM killer's pick, say): the workspace is on the host
            exec_id = api.exec_create(self.container.id, **spec)["Id"]
        sock = api.exec_start(exec_id, socket=True)
        raw = _raw_socket(sock)
        out, err = _Capped(self.limits.max_output_bytes), _Capped(self.limits.max_output_bytes)
        demux = _Demux(out, err)
        timed_out = False
        try:
            if stdin is not None:
                raw.settimeout(max(deadline - time.perf_counter(), 0.001))
                try:
                    raw.sendall(stdin.encode())
                    raw.shutdown(socket.SHUT_WR)
                except (TimeoutError, OSError):
                    pass  # the command stopped reading (or ran past the deadline): its output tells
            raw.setblocking(False)
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select([raw], [], [], left)
                if not ready:
                    continue
                try:
                    data = raw.recv(1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    break
                demux.feed(data)
        finally:
            try:
                sock.close()
            except OSError:
                pass
        code = None
        if timed_out:
            self._kill_all()
            code = 124
        else:
            for _ in range(200):  # the stream closes a moment before the engine records the exit code
                info = api.exec_inspect(exec_id)
                if not info.get("Running") and info.get("ExitCode") is not None:
                    code = info["ExitCode"]
                    break
                time.sleep(0.005)
            if code is None:
                code = 125
        duration = time.perf_counter() - started
        stdout, t1 = out.text()
        stderr, t2 = err.text()
        return ExecResult(stdout, stderr, code, timed_out, duration, t1 or t2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self.container is not None:
                try:
                    self.container.remove(force=True)  # SIGKILL to every process of the container
                except Exception as exc:
                    if "No such container" not in str(exc) and "is already in progress" not in str(exc):
                        raise
            try:
                _unmount(self.workspace)
            finally:
                self._lease.release()
                shutil.rmtree(self._root, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def reap_orphans() -> list[str]:
    """Remove sandbox containers whose owning process (on this host) is gone, e.g. after a worker crash (S17).
    Returns the ids removed."""
    client = docker_client()
    host = socket.gethostname()
    removed = []
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        owner = c.labels.get(f"{LABEL}.owner", "")
        name, _, pid = owner.rpartition(":")
        if name != host or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # the owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        workspaces = [m.get("Source", "") for m in c.attrs.get("Mounts", []) if m.get("Destination") == "/workspace"]
        c.remove(force=True)
        for source in workspaces:  # the host tmpfs it left mounted
            folder = Path(source)
            if folder.parent.parent == SANDBOX_ROOT and folder.parent.name.startswith("dkr-"):
                _unmount(folder)
                shutil.rmtree(folder.parent, ignore_errors=True)
        removed.append(c.id)
    return removed
