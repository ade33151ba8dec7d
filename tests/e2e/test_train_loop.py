"""The whole loop on the CPU: Ray workers, LocalEngine, bubblewrap sandbox, guard, compaction, critic PPO under
DeepSpeed, weight sync, checkpoints, evaluation, and a run killed mid-way and resumed."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rl.checkpoint import Checkpointer
from rl.config import register_configs
from rl.run_log import read_metrics

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
pytestmark = pytest.mark.slow


def config(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=["+experiment=coding_ppo_tiny",
                                                                            *overrides]))


def test_two_steps_end_to_end(scripted_policy, scripted_judge, tmp_path):
    from rl.train import train

    cfg = config(f"model.name={scripted_policy}", f"output_dir={tmp_path}", "trainer.verify_weight_sync=true",
                 "guard=judged", "guard.judge.backend=engine", f"guard.judge.model={scripted_judge}",
                 "agent.context_window=896", "agent.max_turns=5", "engine.temperature=0.5",
                 "logging.episode_log_every=2", "algorithm.reference_every=2")
    final = train(cfg)
    run = tmp_path / "coding_ppo_tiny"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    steps = records[1:]
    assert sum(r["rollout/tool_calls_mean"] for r in steps) > 0
    assert sum(r["rollout/guard_blocks"] for r in steps) > 0, "the scripted policy's hack was never blocked"
    assert sum(r["rollout/compactions"] for r in steps) > 0
    for r in steps:
        assert r["perf/weight_sync_max_abs_diff"] == 0.0 and r["rollout/weight_version"] == r["step"]
        assert math.isfinite(r["actor/grad_norm"]) and math.isfinite(r["critic/grad_norm"])
        if r["adv/raw_std"] > 0:  # some reward signal (bugfix tasks give partial credit): both models moved
            assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
        for key in ("perf/rollout_s", "perf/logprobs_s", "perf/values_s", "perf/train_s", "actor/clipfrac",
                    "critic/value_loss", "critic/explained_variance", "rollout/segments_mean"):
            assert key in r, key
    assert "actor/kl_ref" in steps[0] and "actor/kl_ref" not in steps[1]  # π_ref's pass on steps 1, 3, ... only
    assert "eval/pass_rate" in records[0] and "eval/pass_rate" in records[2]
    audit = [json.loads(line) for line in (run / "guard_audit.jsonl").read_text().splitlines()]
    assert any(e["action"] == "block" and e["stage"] == "rules" and "rm tests/test_visible.py" in e["call"]
               for e in audit)
    judged = [e for e in audit if e["stage"] == "judge"]  # flagged by a rule, blocked by the (scripted) judge
    assert judged and all(e["action"] == "block" and e["judge"]["verdict"] == "hack" for e in judged), \
        [(e["call"], e["rules"], e["action"], e["judge"]) for e in judged]
    assert any("pip-upgrade" in e["rules"] and "pip install -U pytest" in e["call"] for e in judged)
    assert sum(r["guard/judge_rate"] for r in steps) > 0 and all(r["guard/judge_failures"] == 0 for r in steps)
    assert (run / "curves.png").exists() and (run / "summary.json").exists() and final["rollout/episodes"] == 4
    # what the policy wrote: every 2nd episode of each mode, decoded, with its outcome
    logged = [json.loads(line) for f in sorted((run / "episodes").glob("worker*.jsonl")) for line in open(f)]
    assert {e["mode"] for e in logged} == {"train", "eval"} and all(e["n"] % 2 == 1 for e in logged)
    assert all(e["segments"] and "<|im_start|>" in e["segments"][0]["text"] for e in logged)
    assert any(e["compactions"] > 0 and len(e["segments"]) == e["compactions"] + 1 for e in logged)
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "actor" / "hf" / "model.safetensors").exists() and (latest / "critic" / "state").exists()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(latest / "actor" / "hf") is not None


def kill_processes_under(folder: str, timeout_s: float = 30.0) -> None:
    """SIGKILL a Ray cluster by its temp folder: every process whose command line names it (its GCS, raylet and
    agents) and their children (the raylet's workers, whose titles do not), until none is left."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = subprocess.run(["pgrep", "-f", folder], capture_output=True, text=True).stdout.split()
        if not found:
            return
        for pid in found:
            subprocess.run(["pkill", "-9", "-P", pid], capture_output=True)
        subprocess.run(["pkill", "-9", "-f", folder], capture_output=True)
        time.sleep(0.5)


def test_killed_run_resumes_from_its_last_checkpoint(scripted_policy, tmp_path):
    from environments.tasks import SHIPPED_TASKS

    extra = tmp_path / "extra.jsonl"  # a one-task extra evaluation set
    extra.write_text(Path(SHIPPED_TASKS).read_text().splitlines()[0] + "\n")
    args = [sys.executable, "-m", "rl.train", "+experiment=coding_ppo_tiny", f"model.name={scripted_policy}",
            f"output_dir={tmp_path}", "trainer.steps=3", "trainer.eval_at_start=false", "logging.wandb_mode=disabled",
            "trainer.eval_samples=2", "engine.eval_temperature=0.7",
            f"env.extra_eval_tasks={extra}"]
    run = tmp_path / "coding_ppo_tiny"
    # The killed run's Ray gets a temp folder of its own (short: Ray's socket paths must stay under 108 bytes),
    # so that its leftovers can be killed by that path alone. `ray stop --force` would kill every Ray on the
    # machine: it once took down a training job running beside CI.
    ray_tmp = tempfile.mkdtemp(prefix="rlk.", dir=os.environ.get("TMPDIR", "/tmp"))
    killed_log = tmp_path / "killed.log"  # what the killed run printed: the reason, if it ends on its own
    with open(killed_log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": ray_tmp})
    try:
        deadline = time.time() + 600
        while not (run / "checkpoints" / "step_000001" / "trainer_state.json").exists():
            assert proc.poll() is None and time.time() < deadline, \
                "the run ended before its first checkpoint:\n" + killed_log.read_text()[-4000:]
            time.sleep(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_processes_under(ray_tmp)
    # Killed after its first checkpoint: at any point of step 2, or after step 2's checkpoint (even before step
    # 2's line reached metrics.jsonl: the checkpoint keeps the line). A resume starts from the last checkpoint.
    killed_at = Checkpointer.load_state(Checkpointer(run).latest())["step"]
    assert killed_at in (1, 2)
    # Resumed under a time limit that one step exceeds: it checkpoints after one step and stops cleanly
    # (unless that step is the last one, which always runs to the end).
    limited = subprocess.run(args + ["resume=true", "trainer.time_limit_s=1"], capture_output=True, text=True,
                             timeout=900)
    assert limited.returncode == 0, limited.stdout[-3000:] + limited.stderr[-3000:]
    output = limited.stdout + limited.stderr
    assert "resumed from" in output
    if killed_at == 1:
        assert "trainer.time_limit_s=1: stopped after step 2" in output
        assert json.loads((run / "summary.json").read_text())["stopped_early_at_step"] == 2
        assert (run / "checkpoints" / "step_000002" / "trainer_state.json").exists()
    # The rest under time_limit_action=finish with a limit already past: the first step after the resume is made
    # the last one (final evaluation included) instead of stopping for another resume. It resumes from the
    # checkpoint's weights alone (its optimizer state dropped, as a checkpoint carried between machines is),
    # which is refused unless trainer.resume_weights_only=true says so.
    latest = Checkpointer(run).latest()
    for model in ("actor", "critic"):
        shutil.rmtree(latest / model / "state")
    finish = ["resume=true", "trainer.steps=5", "trainer.time_limit_s=1", "trainer.time_limit_action=finish"]
    from rl.train import train  # refused before anything starts (in this process: no subprocess's imports to pay)

    with pytest.raises(ValueError, match="trainer.resume_weights_only=true"):
        train(config(*args[4:], *finish))
    done = subprocess.run(args + finish + ["trainer.resume_weights_only=true"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr and "without its optimizer state" in done.stdout + done.stderr
    last = 3 if killed_at == 1 else 4  # killed at 2, the limited run ran step 3, the last of its 3, to the end
    assert json.loads((run / "summary.json").read_text())["finished_early_at_step"] == last
    records = read_metrics(run / "metrics.jsonl")
    assert records[-1]["eval/episodes"] == 4  # the final evaluation: 2 held-out tasks x 2 samples
    assert records[-1]["eval_extra/episodes"] == 1  # and every record of the extra set, once
    steps = [r["step"] for r in records]
    assert steps == list(range(1, last + 1))  # each step once: none lost at the checkpoint, none repeated after it
    assert json.loads((run / "checkpoints" / f"step_{last:06d}" / "trainer_state.json").read_text())["step"] == last


def test_glm52_tiny_as_policy_and_critic(tmp_path):
    """The sparse architecture (models/glm5: MLA, DSA indexer with IndexShare, MoE) through the whole loop:
    LocalEngine rollouts with MTP speculative decoding, routed-expert replay, chunked logprobs, the value-head
    critic, DeepSpeed updates, weight sync, checkpoints; both models on two ranks with their experts split
    between them (expert parallelism, E = 2, ZeRO-2) and each sequence too (sequence parallelism, S = 2)."""
    from rl.train import train

    cfg = config("model=glm52_tiny", f"output_dir={tmp_path}", "trainer.steps=1", "trainer.eval_at_start=false",
                 "trainer.verify_weight_sync=true", "logging.wandb_mode=disabled", "engine.speculative_steps=2",
                 "algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "engine.return_routed_experts=true",
                 "trainer.actor_ranks=2", "trainer.critic_ranks=2", "trainer.zero_stage=2",
                 "trainer.expert_parallel=2", "trainer.critic_expert_parallel=2", "trainer.sequence_parallel=2")
    final = train(cfg)
    assert final["actor/ranks"] == 2 and final["critic/ranks"] == 2
    assert final["rollout/episodes"] == 4 and final["perf/weight_sync_max_abs_diff"] == 0.0
    # every position a trained logprob depends on ran in the engine (the rest: after the last sampled token)
    assert final["replay/tokens_replayed_frac"] == 1.0 and final["replay/bytes_per_token"] == 2 * 8 * 2
    # π_old (computed before the first optimiser step, with the engine's experts) is the engine's μ
    assert final["mismatch/abs_diff_lag0"] < 1e-5
    assert final["actor/optim_steps"] == 4 and final["critic/optim_steps"] == 4  # PPO mini-batches end to end
    assert final["engine/speculative_rounds"] > 0 and final["engine/accept_length"] >= 1.0
    assert math.isfinite(final["actor/grad_norm"]) and math.isfinite(final["critic/grad_norm"])
    latest = tmp_path / "coding_ppo_tiny" / "checkpoints" / "step_000001"
    config_json = json.loads((latest / "actor" / "hf" / "config.json").read_text())
    assert config_json["model_type"] == "glm_moe_dsa"
    from models import load_model

    assert type(load_model(str(latest / "critic" / "hf"), role="value")).__name__ == "Glm5ForValue"


def test_two_ranks_per_model_then_resume_on_one(tmp_path):
    """trainer.actor_ranks=2 trainer.critic_ranks=2: each model a DeepSpeed world of two Ray actors (gloo) in a
    placement group, the samples split between them (packed micro-batches); weights sync (each rank its share)
    and checkpoint from the group; the run then resumes from that 2-rank ZeRO-2 checkpoint on one rank per model
    through DeepSpeed's universal checkpoint, and goes on with the asynchronous loop."""
    from rl.train import train

    common = [f"output_dir={tmp_path}", "trainer.eval_at_start=false", "logging.wandb_mode=disabled",
              "trainer.verify_weight_sync=true", "algorithm.mini_batches=2", "trainer.zero_stage=2"]
    first = train(config(*common, "trainer.steps=1", "trainer.actor_ranks=2", "trainer.critic_ranks=2"))
    assert first["actor/ranks"] == 2 and first["critic/ranks"] == 2
    assert first["perf/weight_sync_max_abs_diff"] == 0.0 and math.isfinite(first["actor/grad_norm"])
    assert first["actor/optim_steps"] == 2 and first["critic/optim_steps"] == 2
    run = tmp_path / "coding_ppo_tiny"
    assert (run / "checkpoints" / "step_000001" / "actor" / "hf" / "model.safetensors").exists()
    # resumed asynchronously (trainer.max_staleness=1): step 3 trains on episodes that ran through step 2
    second = train(config(*common, "trainer.steps=3", "resume=true", "trainer.max_staleness=1",
                          "trainer.keep_checkpoints=3"))
    assert second["actor/ranks"] == 1 and second["perf/weight_sync_max_abs_diff"] == 0.0
    for model in ("actor", "critic"):
        assert (run / "checkpoints" / "step_000001" / model / "state" / "universal" / "state" / ".complete").exists()
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["async/staleness_max"] <= 1 and r["rollout/weight_version"] == r["step"] for r in records[1:])
    assert records[2]["async/staleness_max"] == 1  # the batch's episodes started before step 2's update


def _parent(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(status.split("\nPPid:\t", 1)[1].split("\n", 1)[0])


def _rollout_worker_pids() -> list[int]:
    """This test's RolloutWorker actor processes (Ray titles them `ray::RolloutWorker...`): only those under this
    process (its Ray cluster's raylet is its child), never another Ray job's on the same machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if not (entry / "cmdline").read_bytes().startswith(b"ray::RolloutWorker"):
                    continue
            except OSError:
                continue
            pid = ancestor = int(entry.name)
            while ancestor > 1 and ancestor != os.getpid():
                ancestor = _parent(ancestor)
            if ancestor == os.getpid():
                pids.append(pid)
    return pids


def _has_sandbox_child(pid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                if f"\nPPid:\t{pid}\n" in status and b"bwrap" in (entry / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


def test_a_killed_rollout_worker_is_restarted_and_the_run_goes_on(tmp_path):
    """Fault injection: SIGKILL to the rollout worker's process while step 1's episodes run. Ray restarts it, it
    gets the current weights before any new episode, the episodes lost with it run again once, and the run
    trains both steps on full batches."""
    import threading

    from rl.train import train

    killed: list[int] = []

    started = tmp_path / "coding_ppo_tiny" / "guard_audit.jsonl"  # opened as the loop starts

    def killer():  # during step 1, once an episode runs on the worker: a bwrap sandbox of its own is up
        deadline = time.time() + 600
        while time.time() < deadline:
            pids = _rollout_worker_pids()
            if pids and started.exists() and _has_sandbox_child(pids[0]):
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    final = train(config(f"output_dir={tmp_path}", "trainer.eval_at_start=false", "logging.wandb_mode=disabled",
                         "trainer.verify_weight_sync=true"))
    thread.join(timeout=5)
    assert killed, "the rollout worker was never found"
    records = read_metrics(tmp_path / "coding_ppo_tiny" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["rollout/episodes"] == 4 for r in records)
    assert sum(r["rollout/workers_restarted"] for r in records) == 1
    assert all(r["perf/weight_sync_max_abs_diff"] == 0.0 for r in records)  # the restarted engine is in step
    assert killed[0] not in _rollout_worker_pids() and math.isfinite(final["actor/grad_norm"])
