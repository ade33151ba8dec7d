"""One SGLang server process: launch, wait for health, stop, restart. Usable directly or as a Ray actor.

The server runs in its own session (process group) so that stopping it kills the scheduler and detokenizer
children too; a pattern kill would also match the shell that started us. Its log goes to a file whose tail is
put into every error, because "the server died" without the reason is useless at 3 a.m.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

from rollout.config import flag_name

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000


class ServerStartError(RuntimeError):
    pass


def server_args(args: Mapping[str, Any]) -> list[str]:
    """`{"tp": 2, "enable-foo": True, "bar": False, "x": [1, 2]}` → `--tp 2 --enable-foo --x 1 2`.

    Keys may be written with `_` or `-` (Hydra users write either); values are passed as strings unchanged.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + flag_name(key)
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised_host(host: str) -> str:
    """The address other machines reach a server at. A server bound to every interface (0.0.0.0, the setting for
    a fleet over several nodes) is advertised by this node's IP, the one Ray uses, so that the trainer, the
    rollout workers and the router on other nodes can reach it; a specific address is advertised as is."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # no route out of this machine (a sandbox): only local clients exist anyway
        return "127.0.0.1"


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ManagedProcess:
    """A server process in its own session, with a log file, a health URL and a clean stop."""

    health_path = "/health"

    def __init__(self, name: str, host: str = "127.0.0.1", port: int | None = None,
                 env: Mapping[str, str] | None = None, log_dir: str | None = None, startup_timeout_s: float = 900.0):
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_dir or os.environ.get("RL_SGLANG_LOG_DIR", "/tmp")) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._advertised: str | None = None  # `advertised_host(host)`, resolved on first use of `url`

    @property
    def url(self) -> str:
        """Resolved once and kept: the health polls read `url` every half second, and each resolution of a
        0.0.0.0 host asks Ray for the node IP. Lazily rather than in `__init__`, so that the lookup happens when
        it always did (at start, inside the Ray actor or after `ray.init`), whatever Ray's state at construction."""
        if self._advertised is None:
            self._advertised = advertised_host(self.host)
        return f"http://{self._advertised}:{self.port}"

    def command_line(self, **overrides) -> list[str]:
        raise NotImplementedError

    def start(self, wait: bool = True, **overrides) -> str:
        """Launch (or relaunch) the process; returns its URL once the health URL answers 200."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        command = self.command_line(**overrides)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts + 1}: {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        self.starts += 1
        if wait:
            self.wait_healthy()
        return self.url

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if http_ok(self.url + self.health_path):
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with code {self.proc.returncode} during start-up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise ServerStartError(f"{self.name} did not become healthy within {timeout_s:.0f} s (stopped); "
                               f"log {self.log_path}:\n{tail}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and http_ok(self.url + self.health_path)

    def pid(self) -> int | None:
        return self.proc.pid if self.alive() else None

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def _signal_group(self, sig: int) -> bool:
        """Signal the server's process group; False when there is none left to signal.

        The group's id is the leader's pid. Once the leader has exited and been reaped, Linux may give that pid
        to a new process (pid_max is 32768 here) as soon as no process of our group is left, and that process may
        lead a group of its own: a signal to the old group id then lands on a stranger (a CI run of the fleet's
        fault tests once sent SIGTERM to another job's Ray GCS that way). So after the leader is gone, a live
        process holding its pid is not ours and the group is left alone; while any member of our group lives, the
        kernel keeps the id reserved and the signal reaches only them."""
        if self.proc.poll() is not None and os.path.exists(f"/proc/{self.proc.pid}"):
            return False
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s` (and to any child left in the group)."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if not self._signal_group(sig):
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._signal_group(signal.SIGKILL)
        self.proc = None

    def restart(self, **overrides) -> str:
        self.stop()
        return self.start(**overrides)

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, as the health monitor sees it (fault-injection tests)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def info(self) -> dict:
        return {"name": self.name, "url": self.url, "pid": self.pid(), "starts": self.starts,
                "log": str(self.log_path)}

    def __del__(self):
        try:
            self.stop(grace_s=1.0)
        except Exception:  # interpreter shutdown: best effort
            pass


# What SGLang 0.5.17 prints when it finds less GPU memory after loading its weights than its mem-fraction-static
# leaves it: it sizes the KV pool from the memory free when it *started* loading, so another process allocating
# on the same GPU meanwhile (a second server, a trainer: several runs or teachers sharing one GPU) makes it refuse
# to start even though the memory it needs is there once the others have settled.
MEMORY_RACE_MARKERS = ("leave no GPU memory for the KV cache", "Not enough memory. Please try to increase")


class SGLangServer(ManagedProcess):
    """`python -m sglang.launch_server --model-path M --host H --port P <args>`.

    A start that fails on a memory race (`MEMORY_RACE_MARKERS` in its log) is retried up to `memory_retries`
    times after a random pause of about `retry_delay_s` (the servers racing for one GPU then start apart); any
    other failure is raised at once."""

    def __init__(self, model_path: str, args: Mapping[str, Any] | None = None,
                 launch_command: Sequence[str] = ("python", "-m", "sglang.launch_server"), name: str = "sglang-0",
                 memory_retries: int = 3, retry_delay_s: float = 15.0, **process):
        super().__init__(name, **process)
        self.model_path = str(model_path)
        self.args = dict(args or {})
        self.command = [sys.executable if c == "python" else c for c in launch_command]
        self.memory_retries, self.retry_delay_s = max(0, memory_retries), retry_delay_s
        self.memory_race_retries = 0  # over the server's life

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        for attempt in range(self.memory_retries + 1):
            try:
                return super().wait_healthy(timeout_s)
            except ServerStartError:
                last_start = self.log_tail().rpartition("===== start ")[2]
                if attempt == self.memory_retries or not any(m in last_start for m in MEMORY_RACE_MARKERS):
                    raise
            pause = self.retry_delay_s * random.uniform(0.5, 1.5)
            log.warning("%s: less GPU memory free after loading than mem-fraction-static allows (another process "
                        "allocated meanwhile, or the fraction is too small; log %s); starting it again in %.0f s "
                        "(retry %d of %d)", self.name, self.log_path, pause, attempt + 1, self.memory_retries)
            self.memory_race_retries += 1
            self.stop()
            time.sleep(pause)
            self.start(wait=False)

    def command_line(self, model_path: str | None = None) -> list[str]:
        managed = {"model-path", "host", "port"}
        clash = [k for k in self.args if flag_name(k) in managed]
        if clash:
            raise ValueError(f"sglang args {clash} are set by the launcher (model path, host, port); remove them")
        return [*self.command, "--model-path", model_path or self.model_path, "--host", self.host,
                "--port", str(self.port), *server_args(self.args)]


class RouterProcess(ManagedProcess):
    """sglang-router (smg 1.9): `python -m smg.launch_router --worker-urls ... --policy P --host H --port P`.
    Episodes stick to one server through the `X-SMG-Routing-Key` header under `consistent_hashing`."""

    health_path = "/readiness"  # 200 once a healthy worker is behind it

    def __init__(self, worker_urls: Sequence[str], policy: str = "consistent_hashing",
                 args: Mapping[str, Any] | None = None,
                 launch_command: Sequence[str] = ("python", "-m", "smg.launch_router"), name: str = "sglang-router",
                 **process):
        super().__init__(name, **process)
        self.worker_urls = list(worker_urls)
        self.policy = policy
        # its Prometheus exporter defaults to port 29000 on every interface: a second router on the node (another
        # fleet, a test run next to a training run) would fail to start on it, so it gets a free port too
        self.args = {"health-check-interval-secs": 5, "log-level": "warn", "prometheus-port": free_port(),
                     **(args or {})}
        self.command = [sys.executable if c == "python" else c for c in launch_command]

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Ready and every worker registered and healthy (registration is asynchronous: a request sent before
        would all go to the first worker, and its key would move later)."""
        import json

        started = time.monotonic()
        super().wait_healthy(timeout_s)
        deadline = started + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/workers", timeout=5) as r:
                    workers = json.load(r).get("workers", [])
                if sum(bool(w.get("is_healthy")) for w in workers) >= len(self.worker_urls):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise ServerStartError(f"{self.name}: not every worker of {self.worker_urls} became healthy behind it; "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def command_line(self) -> list[str]:
        return [*self.command, "--worker-urls", *self.worker_urls, "--policy", self.policy, "--host", self.host,
                "--port", str(self.port), *server_args(self.args)]
