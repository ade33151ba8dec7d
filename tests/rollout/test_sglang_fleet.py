"""SGLangServer, SGLangFleet, SGLangEngine and the weight sync against real server processes that speak SGLang
0.5.17's HTTP shapes (tests/fakes/sglang_server.py: real generation by a small model, real weight loading,
a real gloo process group for the distributed sync) and, when installed, the real sglang-router (smg)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rollout.config import EngineConfig, SGLangConfig
from rollout.sglang.client import SGLangClient
from rollout.sglang.engine import SGLangEngine
from rollout.sglang.fleet import SGLangFleet
from rollout.sglang.server import RouterProcess, SGLangServer, ServerStartError, http_ok, server_args
from rollout.types import SamplingParams

FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" / "sglang_server.py")]


@pytest.fixture(scope="module")
def fleet(tiny_path, tmp_path_factory):
    cfg = SGLangConfig(num_servers=2, launch_command=FAKE, router="off", health_interval_s=0.5, startup_timeout_s=120)
    fleet = SGLangFleet(cfg, tiny_path, log_dir=str(tmp_path_factory.mktemp("sglang")), use_ray=False)
    fleet.start()
    yield fleet
    fleet.stop()


def run(coro):
    return asyncio.run(coro)


async def _with_engine(fn, **kwargs):
    engine = SGLangEngine(**kwargs)
    try:
        return await fn(engine)
    finally:
        await engine.close()


def test_servers_capture_cuda_graphs_only_up_to_the_batch_the_workers_can_fill():
    """2 workers × (64 episodes + 8 spare calls) never batch more than 144 requests on any one server."""
    cfg = EngineConfig(type="sglang", num_workers=2, max_concurrent_episodes=64, sglang=SGLangConfig(args={"tp": 1}))
    args = cfg.server_config().args
    assert args == {"tp": 1, "cuda-graph-max-bs-decode": 144}
    assert server_args(args)[-2:] == ["--cuda-graph-max-bs-decode", "144"]
    assert cfg.sglang.args == {"tp": 1}  # the run's own config is left as it was
    for chosen in ({"cuda_graph_max_bs": 8}, {"--cuda-graph-bs-decode": [1, 2]}, {"disable-cuda-graph": True}):
        cfg = EngineConfig(type="sglang", sglang=SGLangConfig(args=chosen))
        assert cfg.server_config().args == chosen  # the user's choice of graphs stands, in any spelling
    capped = EngineConfig(type="sglang", sglang=SGLangConfig(args={"max_running_requests": 24}))  # runs ≤ 24 at once
    assert capped.server_config().args == {"max_running_requests": 24, "cuda-graph-max-bs-decode": 24}
    unset = EngineConfig(type="sglang", sglang=SGLangConfig(args={"disable-cuda-graph": False}))  # chooses nothing
    assert unset.server_config().args == {"disable-cuda-graph": False, "cuda-graph-max-bs-decode": 40}
    big = EngineConfig(type="sglang", num_workers=8, max_concurrent_episodes=64)  # 576 in flight: SGLang's default
    assert "cuda-graph-max-bs-decode" not in big.server_config().args


def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    server = SGLangServer("/no/such/model", launch_command=FAKE, log_dir=str(tmp_path), startup_timeout_s=60)
    with pytest.raises(ServerStartError, match="exited with code") as err:
        server.start()
    assert "no/such/model" in str(err.value)  # the log tail names the cause
    assert not server.alive()


# Fails its first start as SGLang 0.5.17 does when another process took GPU memory while it loaded, then runs the
# fake server: the retry must start it again; any other start-up failure is not retried.
RACE_ONCE = """
import os, sys
marker, message = sys.argv[1], sys.argv[2]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("ValueError: " + message, flush=True)
    sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


@pytest.mark.parametrize("message, retried", [
    ("Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.05. Raise it above 0.166",
     True),
    ("CUDA error: an illegal memory access was encountered", False)])
def test_a_start_that_lost_a_memory_race_is_retried(tiny_path, tmp_path, message, retried):
    launch = [sys.executable, "-c", RACE_ONCE, str(tmp_path / "failed_once"), message, *FAKE[1:]]
    server = SGLangServer(tiny_path, launch_command=launch, log_dir=str(tmp_path), startup_timeout_s=120,
                          memory_retries=2, retry_delay_s=0.1)
    try:
        if retried:
            assert http_ok(f"{server.start()}/health")
            assert server.starts == 2 and server.memory_race_retries == 1
        else:
            with pytest.raises(ServerStartError, match="illegal memory access"):
                server.start()
            assert server.starts == 1 and server.memory_race_retries == 0
    finally:
        server.stop()


def test_a_server_on_every_interface_is_advertised_by_the_node_ip(tiny_path, tmp_path):
    server = SGLangServer(tiny_path, launch_command=FAKE, host="0.0.0.0", log_dir=str(tmp_path), startup_timeout_s=120)
    try:
        url = server.start()
        assert "0.0.0.0" not in url and url.endswith(f":{server.port}")
        assert http_ok(f"{url}/health")  # reachable at the advertised address
    finally:
        server.stop()


def test_generate_returns_the_models_own_logprobs(fleet, tiny_path):
    """Through HTTP and back: the logprobs equal an independent forward of the same model (transformers)."""
    from transformers import AutoModelForCausalLM

    prompt = [1, 2, 3, 4, 5, 6]

    async def go(engine):
        return await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=10, seed=3))

    result = run(_with_engine(go, urls=fleet.urls))
    assert len(result.output_ids) == len(result.output_logprobs) == 10 and result.finish_reason == "length"
    reference = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    ids = torch.tensor([prompt + result.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(reference(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    expected = logp.gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.output_logprobs), expected, atol=1e-4)


def _affinity(results_by_session) -> None:
    servers_used = set()
    for turns in results_by_session:
        ports = {r.meta["fake_served_by"] for r, _ in turns}
        assert len(ports) == 1, "an episode's turns went to different servers"
        servers_used |= ports
        # turn 2 reuses turn 1's whole prompt from the prefix cache
        assert turns[1][0].meta["cached_tokens"] >= turns[0][1]
    assert len(servers_used) == 2, "every episode landed on one server"


async def _episodes(engine, sessions: int = 12, turns: int = 2):
    async def episode(i):
        prompt, out = [1, 2, 3, 100 + i], []
        for t in range(turns):
            r = await engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=t), session_id=f"episode-{i}")
            out.append((r, len(prompt)))
            prompt = prompt + r.output_ids + [7]
        return out

    return await asyncio.gather(*(episode(i) for i in range(sessions)))


def test_episodes_stick_to_a_server_without_a_router(fleet):
    _affinity(run(_with_engine(_episodes, urls=fleet.urls)))


@pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="sglang-router (smg) is not installed")
def test_episodes_stick_to_a_server_behind_sglang_router(fleet, tmp_path):
    router = RouterProcess(fleet.urls, "consistent_hashing", log_dir=str(tmp_path), startup_timeout_s=60)
    router.start()
    try:
        _affinity(run(_with_engine(_episodes, router_url=router.url)))
    finally:
        router.stop()


@pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="sglang-router (smg) is not installed")
def test_two_routers_run_side_by_side(fleet, tmp_path):
    """Each router gets its own metrics port (smg's default, 29000, would let only one start on a node)."""
    routers = [RouterProcess(fleet.urls, "consistent_hashing", log_dir=str(tmp_path), name=f"router-{i}",
                             startup_timeout_s=60) for i in range(2)]
    try:
        for router in routers:
            router.start()
        assert routers[0].args["prometheus-port"] != routers[1].args["prometheus-port"]
        _affinity(run(_with_engine(_episodes, router_url=routers[1].url)))
    finally:
        for router in routers:
            router.stop()


async def _read(url: str, name: str) -> torch.Tensor:
    client = SGLangClient(url)
    try:
        return torch.tensor(await client.get_weights_by_name(name, 10_000))
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_weight_sync_reaches_every_server_and_stamps_the_version(fleet, tiny_path, tmp_path, mode):
    from safetensors.torch import load_file

    from models.glm5.checkpoint import save_hf  # noqa: F401  (import check only: disk mode writes HF folders)
    from models.deepspeed_worker import free_port
    from rollout.sglang import weights as sync

    original = load_file(f"{tiny_path}/model.safetensors")
    changed = {k: v + 0.25 for k, v in original.items()}
    version = {"tensor": 11, "distributed": 12, "disk": 13}[mode]
    if mode == "tensor":
        run(sync.sync_from_tensors(fleet.urls, [dict(list(changed.items())[:3]), dict(list(changed.items())[3:])],
                                   version))
    elif mode == "distributed":
        stats, group = run(sync.sync_over_group(fleet.urls, [changed], version, "127.0.0.1", free_port(),
                                                backend="gloo"))
        assert stats["bytes"] == sum(t.numel() * t.element_size() for t in changed.values())
        group.close()
    else:
        from safetensors.torch import save_file

        save_file(changed, str(tmp_path / "model.safetensors"))
        run(sync.sync_from_disk(fleet.urls, str(tmp_path), version))
    for url in fleet.urls:
        assert torch.allclose(run(_read(url, "model.norm.weight")), changed["model.norm.weight"])

    async def sample(engine):
        return await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))

    assert run(_with_engine(sample, urls=fleet.urls, weight_version=version)).meta["weight_version"] == version
    run(sync.sync_from_disk(fleet.urls, tiny_path, 0))  # back to the original weights for the next test


def test_abort_by_request_id(fleet):
    async def go(engine):
        task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3000), request_id="long"))
        await asyncio.sleep(1.0)
        await engine.abort(["long"])
        return await task

    result = run(_with_engine(go, urls=fleet.urls))
    assert result.finish_reason == "abort" and len(result.output_ids) < 3000


def test_an_abort_that_comes_before_the_request_reaches_a_server(fleet):
    """Found on the H200: the engine was still waiting for a server that served its weight version when the
    abort came, so the abort found no server to send to and the request later ran to its full length. Now a
    request aborted while it waits is never sent, and an abort of an id not in flight leaves that id usable."""
    async def go(engine):
        await engine.abort(["later"])  # not in flight: ignored
        task = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3000), request_id="early"))
        await asyncio.sleep(0.5)  # no server serves version 7 yet: the request waits in the engine
        await engine.abort(["early"])
        early = await asyncio.wait_for(task, 30)
        engine.set_weight_version(0)
        later = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="later")
        return early, later

    early, later = run(_with_engine(go, urls=fleet.urls, weight_version=7))
    assert early.finish_reason == "abort" and early.output_ids == [] and "server" not in early.meta
    assert later.finish_reason == "length" and len(later.output_ids) == 2


def test_requests_cut_by_a_weight_update_continue_on_the_new_weights(fleet, tiny_path, tmp_path):
    """pause_mode=abort: in-flight requests end with 'abort' on the server, with what they had sampled; the engine
    continues each from there once the new version is served (a partial rollout). Every request returns once,
    complete, each token stamped with the version that sampled it."""
    from rollout.sglang.weights import sync_from_disk

    def decode_steps() -> list[int]:
        return [json.loads(urllib.request.urlopen(f"{u}/server_info", timeout=10).read())["fake_decode_steps"]
                for u in fleet.urls]

    async def go(engine):
        # long enough that no request can finish before the update on a quiet machine either
        sampling = [SamplingParams(max_new_tokens=NEW, seed=i, ignore_eos=True) for i in range(4)]
        before = await asyncio.to_thread(decode_steps)
        requests = [asyncio.create_task(engine.generate([1, 2, 3, i], sampling[i])) for i in range(4)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until a server has sampled a few tokens for its requests
            now = await asyncio.to_thread(decode_steps)
            if any(n - b >= 5 for n, b in zip(now, before)):
                break
            await asyncio.sleep(0.05)
        await sync_from_disk(fleet.urls, tiny_path, 21, pause_mode="abort")
        engine.set_weight_version(21)
        return await asyncio.gather(*requests), engine.stats.aborted_by_server

    NEW = 600  # far more decode steps than pass between the poll (5 steps in) and the pause
    results, aborted = run(_with_engine(go, urls=fleet.urls))
    assert aborted >= 1
    assert all(r.finish_reason == "length" and len(r.output_ids) == NEW for r in results)
    versions = [r.versions() for r in results]
    assert all(v == sorted(v) and set(v) <= {0, 21} for v in versions)
    assert all(r.meta["weight_version"] == v[-1] for r, v in zip(results, versions))  # the last attempt's server
    assert any(v[0] == 0 and v[-1] == 21 for v in versions), "no request kept its tokens across the update"


@pytest.fixture
def slow_fleet(tiny_path, tmp_path):
    """Two servers of their own (this test kills one) that take 10 ms a generated token, so that 300-token
    requests are still running when the test kills a server, however fast the machine generates."""
    cfg = SGLangConfig(num_servers=2, launch_command=FAKE, router="off", health_interval_s=0.5, startup_timeout_s=120,
                       env={"FAKE_SGLANG_DECODE_S_PER_TOKEN": "0.01"})
    fleet = SGLangFleet(cfg, tiny_path, log_dir=str(tmp_path), use_ray=False)
    fleet.start()
    yield fleet
    fleet.stop()


def test_a_dead_server_loses_no_request_and_is_restarted_with_the_weights(slow_fleet):
    """Kill one server while requests run on both: they finish on the other; the monitor restarts the dead one
    and calls the re-sync hook with that server only; once it serves the current version, the engine uses it
    again. (Re-syncing the whole fleet used to pause the survivor too, whose aborted requests then waited 300 s
    for a newer weight version that a same-version re-sync never brings: the CI run that took 314 s.)"""
    from rollout.sglang.weights import sync_from_disk

    fleet, resyncs = slow_fleet, []

    def resync(urls):
        run(sync_from_disk(urls, fleet.model_path, 21))
        resyncs.append(urls)

    run(sync_from_disk(fleet.urls, fleet.model_path, 21))  # the engine takes servers at its weight version only
    fleet.start_monitor(resync)

    async def go(engine):
        requests = [asyncio.create_task(engine.generate([5, 6, 7, i], SamplingParams(max_new_tokens=300, seed=i),
                                                        session_id=f"ep-{i}")) for i in range(8)]
        servers = await engine._servers_map()
        while not all(s.inflight for s in servers.values()):  # both servers hold requests (3 s each at least)
            await asyncio.sleep(0.01)
        assert not any(r.done() for r in requests)
        fleet.kill(0)
        results = await asyncio.gather(*requests)
        deadline = time.monotonic() + 120
        while not resyncs and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        # until the engine has probed the restarted server back in: sessions picked while that probe is in flight
        # go to the survivor (as they should), and on a loaded machine that could be all eight
        while not all(s.up for s in servers.values()) and time.monotonic() < deadline:
            await engine._recheck(servers)
            await asyncio.sleep(0.1)
        after = await _episodes(engine, sessions=8, turns=1)
        return results, engine.stats, after

    results, stats, after = run(_with_engine(go, urls=fleet.urls, weight_version=21, health_interval_s=0.5,
                                             abort_wait_s=30))
    assert all(len(r.output_ids) == 300 for r in results)
    assert stats.server_failures >= 1 and stats.retries >= 1
    # Each failed-over request runs again from the start on the survivor (≥ 3 s); a survivor paused by a
    # re-sync would abort its requests and hold them for abort_wait_s (set below the 300 s default to show it)
    assert stats.aborted_by_server == 0, "a survivor's requests were aborted by the restart's re-sync"
    assert fleet.restarts == 1 and resyncs == [[fleet.urls[0]]]  # only the restarted server is re-synced
    assert {turns[0][0].meta["fake_served_by"] for turns in after} == {int(u.rsplit(":", 1)[1]) for u in fleet.urls}
