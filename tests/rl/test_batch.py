import pytest
import torch

from critic.reference import gae_naive
from rl.batch import add_advantages, boundary_value_drop, to_samples, trainable
from rl.config import AlgorithmConfig
from rollout.types import Segment, Trajectory


def seg(rid, index, mask, values):
    n = len(mask)
    return Segment(rid, index, list(range(100, 100 + n)), mask, [-0.1 * m for m in mask],
                   "final" if index else "summary_closed"), values


def build(reward=1.0):
    s0, v0 = seg("r", 0, [0, 0, 1, 1, 0, 1], [0, 0, 0.1, 0.2, 9.0, 0.3])
    s1, v1 = seg("r", 1, [0, 0, 0, 1, 1], [5.0, 5.0, 5.0, 0.4, 0.5])
    t = Trajectory("r", "task", [s0, s1], reward=reward, finish_reason="submitted")
    return t, [v0, v1]


@pytest.mark.parametrize("lam", [1.0, 0.8])
def test_chained_advantages_match_naive_loop_over_the_concatenated_trajectory(lam):
    traj, values = build()
    samples = to_samples([traj])
    for s, v in zip(samples, values):
        s["values"] = v
    algo = AlgorithmConfig(gamma=0.95, lam_policy=lam, lam_critic=1.0, normalize_advantages=False)
    add_advantages(samples, [traj], algo)
    # reference: the naive loop over both segments glued together in time order
    mask = torch.tensor([traj.segments[0].loss_mask + traj.segments[1].loss_mask])
    v = torch.tensor([values[0] + values[1]], dtype=torch.float64)
    r = torch.zeros_like(v)
    r[0, -1] = 1.0
    ref_adv, _ = gae_naive(r, v, mask, 0.95, lam)
    _, ref_ret = gae_naive(r, v, mask, 0.95, 1.0)
    got_adv = torch.cat([samples[0]["advantages"], samples[1]["advantages"]])
    got_ret = torch.cat([samples[0]["returns"], samples[1]["returns"]])
    assert got_adv.dtype == got_ret.dtype == torch.float32  # per-token fields travel as tensors (rl/group.py)
    assert got_adv.tolist() == pytest.approx(ref_adv[0].tolist(), abs=1e-6)
    assert got_ret.tolist() == pytest.approx(ref_ret[0].tolist(), abs=1e-6)
    assert samples[0]["old_values"].tolist() == pytest.approx(values[0])


def test_kl_in_reward_and_whitening():
    traj, values = build(reward=0.0)
    samples = to_samples([traj])
    for s, v in zip(samples, values):
        s["values"] = [0.0] * len(v)
        s["old_logprobs"] = [-1.0] * len(v)
        s["ref_logprobs"] = [-1.5] * len(v)
    m = add_advantages(samples, [traj], AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", normalize_advantages=False))
    # γ = λ = 1, V = 0: A at the j-th of N action tokens = −0.1·0.5·(N − j)
    adv = [float(a) for s in samples for a, k in zip(s["advantages"], s["loss_mask"]) if k]
    assert adv == pytest.approx([-0.05 * (5 - j) for j in range(5)])
    assert m["adv/kl_in_reward"] == pytest.approx(0.5)
    add_advantages(samples, [traj], AlgorithmConfig(kl_coef=0.1, normalize_advantages=True))
    adv = torch.tensor([float(a) for s in samples for a, k in zip(s["advantages"], s["loss_mask"]) if k])
    assert abs(float(adv.mean())) < 1e-6


def test_trainable_filters_and_boundary_drop():
    good, values = build()
    bad = Trajectory("e", "task", [], finish_reason="error")
    empty = Trajectory("z", "task", [], finish_reason="max_turns")
    kept, dropped = trainable([good, bad, empty])
    assert kept == [good] and dropped == {"error": 1, "no_action_tokens": 1}
    samples = to_samples(kept)
    for s, v in zip(samples, values):
        s["values"] = v
    assert boundary_value_drop(samples) == pytest.approx(0.4 - 0.3)


def test_per_segment_advantages_treat_each_segment_as_an_episode_ending_in_the_reward():
    traj, values = build()
    samples = to_samples([traj])
    for s, v in zip(samples, values):
        s["values"] = v
    add_advantages(samples, [traj], AlgorithmConfig(gamma=0.95, lam_policy=0.8, lam_critic=1.0,
                                                    normalize_advantages=False, chain_segments=False))
    for s, seg_, v in zip(samples, traj.segments, values):  # the naive loop on the segment alone, R at its end
        mask = torch.tensor([seg_.loss_mask])
        vv = torch.tensor([v], dtype=torch.float64)
        r = torch.zeros_like(vv)
        r[0, max(i for i, m in enumerate(seg_.loss_mask) if m)] = 1.0
        ref_adv, _ = gae_naive(r, vv, mask, 0.95, 0.8)
        _, ref_ret = gae_naive(r, vv, mask, 0.95, 1.0)
        assert s["advantages"].tolist() == pytest.approx(ref_adv[0].tolist(), abs=1e-6)
        assert s["returns"].tolist() == pytest.approx(ref_ret[0].tolist(), abs=1e-6)
    chained = to_samples([traj])
    for s, v in zip(chained, values):
        s["values"] = v
    add_advantages(chained, [traj], AlgorithmConfig(gamma=0.95, lam_policy=0.8, normalize_advantages=False))
    assert chained[0]["advantages"].tolist() != pytest.approx(samples[0]["advantages"].tolist(), abs=1e-3)


def test_step_rewards_sit_on_their_reply_and_reach_only_the_tokens_before():
    """A malformed-call penalty on the last token of the reply that made it (γ = λ = 1, V = 0): each action
    token's advantage is the sum of the rewards at or after it, the terminal reward included."""
    s0, _ = seg("r", 0, [0, 1, 1, 0, 1, 1, 0], [0.0] * 7)
    s0.step_rewards = [(2, -0.1)]  # the first reply (positions 1-2)
    s1, _ = seg("r", 1, [0, 1, 1], [0.0] * 3)
    s1.step_rewards = [(2, -0.05)]
    traj = Trajectory("r", "task", [s0, s1], reward=1.0, finish_reason="submitted")
    samples = to_samples([traj])
    for s in samples:
        s["values"] = [0.0] * len(s["token_ids"])
    m = add_advantages(samples, [traj], AlgorithmConfig(normalize_advantages=False))
    adv = [round(float(a), 6) for s in samples for a, k in zip(s["advantages"], s["loss_mask"]) if k]
    assert adv == pytest.approx([0.85, 0.85, 0.95, 0.95, 0.95, 0.95])
    assert m["adv/step_reward_per_episode"] == pytest.approx(-0.15)


def test_a_step_reward_on_a_masked_reply_moves_to_the_action_before_it():
    s0, _ = seg("r", 0, [0, 1, 1, 0, 0, 0, 1], [0.0] * 7)
    s0.step_rewards = [(5, -0.2)]  # a reply at 4-5 whose loss mask the guard cleared
    traj = Trajectory("r", "task", [s0], reward=0.0, finish_reason="submitted")
    samples = to_samples([traj])
    samples[0]["values"] = [0.0] * 7
    add_advantages(samples, [traj], AlgorithmConfig(normalize_advantages=False))
    assert samples[0]["advantages"][[1, 2, 6]].tolist() == pytest.approx([-0.2, -0.2, 0.0])


def test_step_rewards_must_point_into_the_segment():
    with pytest.raises(ValueError, match="step rewards at positions"):
        Segment("r", 0, [1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], step_rewards=[(3, -0.1)])
