"""Sandboxes: one contract (base.py), `make_sandbox(backend, **limits)` here, a module per backend.

`bwrap` (default): bubblewrap with new PID, network, IPC and UTS namespaces, a read-only view of /usr and of
the Python installation, a private /tmp, and the episode's workspace bound read-write at /workspace. As root
(the normal case), one bwrap lives as long as the sandbox with a resident executor inside
(environments/sandbox/bwrap_executor.py) that runs each call as an unprivileged uid of the sandbox's own (one uid per
live sandbox, so RLIMIT_NPROC contains fork bombs per sandbox) with no capabilities and no_new_privs, and kills
everything the call started when it ends or times out: a call costs a fork and an exec (+2.6 ms over a plain
subprocess) instead of a new bwrap (+17-30 ms). Not as root, or with `resident=False`, every `exec` is its own
bwrap invocation, dropping to the uid through prlimit(1) and setpriv(1) as root; a timeout kills bwrap and with
it the whole PID namespace. Either way, limits on address space, CPU seconds, file size, process count and open
files are rlimits inherited by everything the command starts.

`docker`: one container per sandbox, behind the same contract (environments/sandbox/docker.py).
"""

from __future__ import annotations

from dataclasses import fields

from environments.sandbox.base import SANDBOX_ROOT, Sandbox, SandboxLimits
from environments.sandbox.bwrap import BwrapSandbox, bwrap_binary

__all__ = ["BACKENDS", "SANDBOX_ROOT", "Sandbox", "SandboxLimits", "BwrapSandbox", "bwrap_binary", "make_sandbox",
           "task_sandbox_options"]

BACKENDS = ("bwrap", "docker")
SIZE_OPTIONS = ("workspace_mb", "tmp_mb")  # both backends: size caps of the workspace and of /tmp


def make_sandbox(backend: str = "bwrap", **limits) -> Sandbox:
    """A new sandbox. `limits`: any `SandboxLimits` field, `workspace_mb` and `tmp_mb` (size caps); the docker
    backend also takes `image` and `cpus` (environments/sandbox/docker.py `DockerOptions`), the bwrap backend
    `resident` (False: a new bwrap per call instead of the resident executor)."""
    if backend == "bwrap":
        from environments.sandbox.docker import DOCKER_OPTIONS

        docker_only = sorted(set(limits) & set(DOCKER_OPTIONS) - set(SIZE_OPTIONS))
        if docker_only:
            raise TypeError(f"{docker_only} are options of the docker backend; the bwrap backend does not take them")
        sizes = {k: limits.pop(k) for k in SIZE_OPTIONS if k in limits}
        resident = limits.pop("resident", None)
        return BwrapSandbox(SandboxLimits.from_kwargs(**limits), resident=resident, **sizes)
    if backend == "docker":
        from environments.sandbox.docker import DOCKER_OPTIONS, DockerOptions, DockerSandbox

        unknown = set(limits) - set(DOCKER_OPTIONS) - {f.name for f in fields(SandboxLimits)}
        if unknown:
            raise TypeError(f"unknown sandbox limits {sorted(unknown)}; known: "
                            f"{sorted({f.name for f in fields(SandboxLimits)})} and docker's {list(DOCKER_OPTIONS)}")
        options = {k: limits.pop(k) for k in list(limits) if k in DOCKER_OPTIONS}
        if options.get("image", "") is None:  # None: no image of the task's own, the default one
            options.pop("image")
        return DockerSandbox(SandboxLimits.from_kwargs(**limits), DockerOptions(**options))
    raise ValueError(f"unknown sandbox backend {backend!r}; use one of {list(BACKENDS)}")


def task_sandbox_options(task, backend: str) -> dict:
    """Per-task sandbox options: with Docker, the task's own image (metadata `docker_image`), if it names one."""
    image = (task.metadata or {}).get("docker_image")
    if backend != "docker" or image is None:
        return {}
    if not isinstance(image, str) or not image.strip():
        raise ValueError(f"task {task.id}: docker_image must be a non-empty image name, got {image!r}")
    return {"image": image}
