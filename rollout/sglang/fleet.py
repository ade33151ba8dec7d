"""The SGLang fleet of a run: server processes as Ray actors (GPUs from the config), sglang-router in front of
several, and a health monitor that restarts a dead server and has the trainer re-sync its weights.

    fleet = SGLangFleet(cfg.engine.sglang, model_path, log_dir)
    fleet.start()                        # every server in parallel; the router once they are healthy
    engine_kwargs = fleet.endpoint()     # what each rollout worker's SGLangEngine connects to
    fleet.start_monitor(on_restart)      # on_restart(urls): push the current weights to the restarted servers
    ...
    fleet.stop()

With `urls` (or `router_url`) in the config the fleet attaches to servers someone else runs and launches nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time

import ray

from rollout.config import SGLangConfig
from rollout.sglang.server import RouterProcess, SGLangServer

log = logging.getLogger(__name__)


class SGLangFleet:
    def __init__(self, cfg: SGLangConfig, model_path: str, log_dir: str | None = None, use_ray: bool = True):
        self.cfg = cfg
        self.use_ray = use_ray  # False: server processes of this process (rl.evaluate, tests)
        self.model_path = str(model_path)
        self.log_dir = log_dir
        self.servers: list = []  # SGLangServer: Ray actor handles (use_ray) or local objects
        self.urls: list[str] = list(cfg.urls)
        self.router: RouterProcess | None = None
        self.router_url: str | None = cfg.router_url or None
        self.restarts = 0
        self.sync_fallbacks = 0  # weight syncs that failed in the configured mode (engine.sglang.weight_sync_fallback)
        self.sync_lock = threading.RLock()  # a weight sync and a restart's re-sync never interleave
        self._monitor: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def launched(self) -> bool:
        return bool(self.servers)

    def start(self) -> None:
        cfg = self.cfg
        env = dict(cfg.env)
        if cfg.weight_sync == "distributed":  # see rollout/sglang/weights.py: UpdateGroup
            env.setdefault("NCCL_CUMEM_ENABLE", "0")
        if not self.urls and not self.router_url:
            make = ray.remote(num_cpus=0, num_gpus=cfg.gpus_per_server)(SGLangServer).remote if self.use_ray \
                else SGLangServer
            self.servers = [make(self.model_path, dict(cfg.args), list(cfg.launch_command), name=f"sglang-{i}",
                                 host=cfg.host, env=env, log_dir=self.log_dir,
                                 startup_timeout_s=cfg.startup_timeout_s, memory_retries=cfg.memory_retries)
                            for i in range(cfg.num_servers)]
            started = time.perf_counter()
            self._each("start", wait=False)  # all servers load at once
            self._each("wait_healthy")
            self.urls = self._each("info")
            self.urls = [info["url"] for info in self.urls]
            log.info("%d SGLang server(s) up in %.0f s: %s", len(self.urls), time.perf_counter() - started, self.urls)
        use_router = cfg.router == "on" or (cfg.router == "auto" and len(self.urls) > 1)
        if use_router and cfg.router == "auto" and not self.router_url and importlib.util.find_spec("smg") is None:
            log.warning("sglang-router (pip install smg) is not installed: episodes are kept on their server by "
                        "the client (rendezvous hashing) instead")
            use_router = False
        if use_router and not self.router_url:
            self.router = RouterProcess(self.urls, cfg.router_policy, host=cfg.host, log_dir=self.log_dir,
                                        startup_timeout_s=120.0)
            self.router_url = self.router.start()
            log.info("sglang-router (%s) at %s", cfg.router_policy, self.router_url)

    def endpoint(self) -> dict:
        """Keyword arguments of `SGLangEngine` for the rollout workers."""
        return {"urls": list(self.urls), "router_url": self.router_url}

    # ---- health ----------------------------------------------------------------------------------
    def dead(self) -> list[int]:
        """Servers whose process is gone (a /health miss alone is not death: it is 503 during a long pause)."""
        if not self.servers:
            return []
        out = []
        for i in range(len(self.servers)):
            try:
                if not self._call(i, "alive"):
                    out.append(i)
            except (ray.exceptions.RayError, TimeoutError):
                out.append(i)
        return out

    def restart(self, indices: list[int]) -> list[str]:
        """Restart these servers (each keeps its port, so its URL); returns their URLs."""
        for i in indices:
            if self.restarts >= self.cfg.max_restarts * max(len(self.servers), 1):
                raise RuntimeError(f"SGLang server restarts exhausted ({self.restarts}); see the logs in {self.log_dir}")
            tail = self._call(i, "log_tail", 2000)
            log.warning("SGLang server %d (%s) died; restarting. Log tail:\n%s", i, self.urls[i], tail)
            self._call(i, "restart")
            self.restarts += 1
        return [self.urls[i] for i in indices]

    def start_monitor(self, on_restart) -> None:
        """Every `health_interval_s`: restart dead servers, then `on_restart(urls)` with the restarted servers'
        URLs (re-sync their weights), under `sync_lock` so that it never runs inside a weight sync.

        Only the restarted servers: the others hold the current weights already, and a sync pauses a server and
        aborts what it is running. An aborted request waits for a newer weight version before it runs again
        (SGLangEngine), and a re-sync of the same version never brings one: re-syncing the whole fleet made the
        survivors' requests wait out the engine's abort_wait_s (300 s) after every restart."""
        if not self.servers or self._monitor is not None:
            return

        def loop():
            while not self._stopping.wait(self.cfg.health_interval_s):
                try:
                    with self.sync_lock:
                        dead = self.dead()
                        if dead and not self._stopping.is_set():
                            on_restart(self.restart(dead))
                except Exception:  # the monitor must survive to try again; the run sees it in the log
                    log.exception("SGLang health monitor")

        self._monitor = threading.Thread(target=loop, name="sglang-monitor", daemon=True)
        self._monitor.start()

    def kill(self, index: int) -> None:
        """Crash one server (fault-injection tests and drills)."""
        self._call(index, "kill")

    def stop(self) -> None:
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join(timeout=60)
        if self.router is not None:
            self.router.stop()
        if self.servers:
            self._each("stop")
            if self.use_ray:
                for s in self.servers:
                    ray.kill(s)
        self.servers = []

    # ---- servers, as Ray actors or local objects ------------------------------------------------------
    def _call(self, index: int, method: str, *args, **kwargs):
        server = self.servers[index]
        if self.use_ray:
            # a restart may start the server up to 1 + memory_retries times (rollout/sglang/server.py)
            timeout = self.cfg.startup_timeout_s * (1 + max(0, self.cfg.memory_retries))
            return ray.get(getattr(server, method).remote(*args, **kwargs), timeout=timeout)
        return getattr(server, method)(*args, **kwargs)

    def _each(self, method: str, *args, **kwargs) -> list:
        if self.use_ray:
            return ray.get([getattr(s, method).remote(*args, **kwargs) for s in self.servers])
        return [getattr(s, method)(*args, **kwargs) for s in self.servers]
