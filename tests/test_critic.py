"""The critic (algo.name: ppo): GAE on packed rows vs a numpy loop over each trajectory,
value alignment vs transformers, packed vs padded, learning, meshes, checkpoints, bad input."""

import copy
import dataclasses

import jax
import numpy as np
import pytest
import torch
from _learner_data import (
    FAST_COMPILE,
    TINY,
    init_model,
    make_learner,
    random_trajectories,
)
from hf_fixtures import make_hf_model, make_tiny_hf_checkpoint
from tolerance import (
    decoder_path_length,
    hf_path_length,
    network_tolerance,
    reference_tolerance,
)

from areal_jax.checkpoint import CheckpointMeta, TrainCheckpointer
from areal_jax.learner import AlgoConfig, OptimConfig, pack_trajectories, unpack_per_token
from areal_jax.learner.critic import Critic, packed_gae_targets
from areal_jax.learner.packing import PACKED_FIELDS
from areal_jax.parallel import make_mesh
from areal_jax.trajectory import Trajectory

OPTIM = OptimConfig(lr=3e-3, max_grad_norm=1.0, eps=1e-6)


def one_device():
    return make_mesh("data=1", jax.devices()[:1])


def make_critic(mesh=None, **kwargs) -> Critic:
    kwargs.setdefault("compiler_options", FAST_COMPILE)
    return Critic(init_model(TINY, seed=0), TINY, kwargs.pop("optim", OPTIM),
                  mesh=mesh or one_device(), **kwargs)


# Every test on the shared critic packs into [4, 32] micro-batches: one compilation each.
SHAPE = dict(seq_len=32, rows_per_micro_batch=4)


@pytest.fixture(scope="module")
def _shared_critic():
    critic = make_critic(ppo_n_minibatches=2)
    initial = jax.tree.map(np.asarray, (critic.params, critic.opt_state))
    return critic, initial


@pytest.fixture
def critic(_shared_critic) -> Critic:
    """The module's critic, reset to its initial weights, optimizer state and counters."""
    shared, (params, opt_state) = _shared_critic
    shared.load_state(params, opt_state, step=0, version=0)
    return shared


def multi_turn_trajectories(seed: int, n: int) -> list[Trajectory]:
    """Prompt, then generated / environment / generated spans (env tokens masked)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        spans = [(int(rng.integers(1, 6)), 0)]
        for k in range(int(rng.integers(1, 4))):
            if k:
                spans.append((int(rng.integers(1, 5)), 0))  # an environment turn
            spans.append((int(rng.integers(1, 7)), 1))
        mask = np.concatenate([np.full(length, m) for length, m in spans]).astype(np.int32)
        out.append(Trajectory(input_ids=rng.integers(0, 128, mask.size), loss_mask=mask,
                              behav_logp=-mask.astype(np.float32),
                              versions=np.where(mask == 1, 0, -1), reward=float(rng.normal())))
    return out


def per_token_rows(batches, per_traj: list[np.ndarray]) -> list[np.ndarray]:
    """Per-trajectory [T_i] arrays -> one fp32 [R, L] array per micro-batch, by the
    placements (0 elsewhere): the inverse of ``unpack_per_token``."""
    out = []
    for b in batches:
        arr_rl = np.zeros(b.shape, np.float32)
        for p in b.placements:
            arr_rl[p.row, p.start:p.start + p.length] = per_traj[p.traj_index]
        out.append(arr_rl)
    return out


def packed_gae_per_trajectory(trajs: list[Trajectory], values: list[np.ndarray], gamma: float,
                              lam: float, *, rewards=None, normalize: bool = False):
    """GAE of each trajectory through the packed path: ``trajs`` packed several to a row
    into several micro-batches, ``values`` placed in their rows, ``packed_gae_targets``,
    and the advantages and returns unpacked again ([T_i] each)."""
    batches = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=2,
                                n_minibatches=2, row_lengths=[16])
    assert len(batches) >= 3 and max(b.segment_ids.max() for b in batches) >= 2
    rewards = [t.reward for t in trajs] if rewards is None else rewards
    targets = packed_gae_targets(batches, per_token_rows(batches, values), rewards,
                                 gamma=gamma, lam=lam, normalize=normalize)
    advantages = [np.asarray(b.advantages) for b in targets.micro_batches]
    returns = [np.asarray(r) for r in targets.returns]
    return (unpack_per_token(batches, advantages, len(trajs)),
            unpack_per_token(batches, returns, len(trajs)))


def gae_reference(traj: Trajectory, values: np.ndarray, reward: float, gamma: float, lam: float):
    """A plain loop over the loss tokens only, written independently of areal_jax.losses.gae."""
    idx = [t for t in range(traj.num_tokens) if traj.loss_mask[t]]
    adv = np.zeros(traj.num_tokens)
    ret = np.zeros(traj.num_tokens)
    next_value, next_adv = 0.0, 0.0
    for k in reversed(range(len(idx))):
        t = idx[k]
        r = reward if k == len(idx) - 1 else 0.0
        delta = r + gamma * next_value - values[t]
        adv[t] = delta + gamma * lam * next_adv
        ret[t] = adv[t] + values[t]
        next_value, next_adv = values[t], adv[t]
    return adv, ret


def gae_tolerance(traj: Trajectory, values: np.ndarray, reward: float, gamma: float,
                  lam: float) -> tuple[np.ndarray, np.ndarray]:
    """fp32 bounds on (advantages, returns) against the float64 loop: the advantage at t sums
    (gamma lam)^k delta over the rest of the loss tokens, each delta = r + gamma V' - V, so
    its terms' magnitudes follow the same recursion on |r| + gamma |V'| + |V| (4 operations
    a step); the return adds |V|."""
    idx = [t for t in range(traj.num_tokens) if traj.loss_mask[t]]
    size = np.zeros(traj.num_tokens)
    next_value, next_size = 0.0, 0.0
    for k in reversed(range(len(idx))):
        t = idx[k]
        r = abs(reward) if k == len(idx) - 1 else 0.0
        size[t] = r + gamma * next_value + abs(values[t]) + gamma * lam * next_size
        next_value, next_size = abs(values[t]), size[t]
    adv_tol = reference_tolerance(size, len(idx), ops=4)
    return adv_tol, adv_tol + reference_tolerance(size + np.abs(values), 1, ops=1)


# ----------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_numpy_loop_with_env_tokens(gamma, lam):
    trajs = multi_turn_trajectories(0, 12)
    assert any(np.any(np.diff(t.loss_mask) == -1) for t in trajs)  # env turns in the middle
    rng = np.random.default_rng(1)
    values = [rng.normal(size=t.num_tokens).astype(np.float32) for t in trajs]
    rewards = rng.normal(size=len(trajs))
    adv, ret = packed_gae_per_trajectory(trajs, values, gamma, lam, rewards=rewards)
    for i, t in enumerate(trajs):
        want_adv, want_ret = gae_reference(t, values[i], rewards[i], gamma, lam)
        adv_tol, ret_tol = gae_tolerance(t, values[i], rewards[i], gamma, lam)
        assert np.all(np.abs(adv[i] - want_adv) <= adv_tol), f"traj {i}"
        assert np.all(np.abs(ret[i] - want_ret) <= ret_tol), f"traj {i}"
        assert adv[i].dtype == np.float32 and adv[i].shape == (t.num_tokens,)
    if (gamma, lam) == (1.0, 1.0):  # undiscounted Monte Carlo: returns = the reward
        for i, t in enumerate(trajs):
            ret_tol = gae_tolerance(t, values[i], rewards[i], gamma, lam)[1]
            assert np.all(np.abs(ret[i] - rewards[i])[t.loss_mask == 1]
                          <= ret_tol[t.loss_mask == 1])


def test_gae_default_rewards_and_normalisation():
    trajs = multi_turn_trajectories(2, 9)
    rng = np.random.default_rng(3)
    values = [rng.normal(size=t.num_tokens).astype(np.float32) for t in trajs]
    raw_adv, raw_ret = packed_gae_per_trajectory(trajs, values, 0.95, 0.9)
    raw_tol = []
    for i, t in enumerate(trajs):  # default reward: trajectory.reward
        raw_tol.append(gae_tolerance(t, values[i], t.reward, 0.95, 0.9)[0])
        want = gae_reference(t, values[i], t.reward, 0.95, 0.9)[0]
        assert np.all(np.abs(raw_adv[i] - want) <= raw_tol[-1]), f"traj {i}"
    adv, ret = packed_gae_per_trajectory(trajs, values, 0.95, 0.9, normalize=True)
    mask = np.concatenate([t.loss_mask for t in trajs]) == 1
    flat_raw = np.concatenate(raw_adv)[mask].astype(np.float64)
    std = flat_raw.std() + 1e-5
    # Normalised from the same fp32 advantages: (a - mean) / (std + eps), the mean and the
    # variance sums over the loss tokens, ~10 operations a term.
    tol = reference_tolerance((np.abs(flat_raw) + np.abs(flat_raw).mean()) / std, mask.sum(),
                              ops=10)
    assert np.all(np.abs(np.concatenate(adv)[mask] - (flat_raw - flat_raw.mean()) / std) <= tol)
    assert np.all(np.concatenate(adv)[~mask] == 0)
    for r, rr in zip(ret, raw_ret, strict=True):  # returns are not normalised
        np.testing.assert_array_equal(r, rr)


def test_per_token_rows_is_the_inverse_of_unpack():
    """The tests' own placement of per-trajectory arrays into packed rows is right."""
    trajs = random_trajectories(5, 23, 20)
    batches = pack_trajectories(trajs, None, seq_len=48, rows_per_micro_batch=4, n_shards=2,
                                n_minibatches=2)
    assert max(b.segment_ids.max() for b in batches) >= 2
    rng = np.random.default_rng(0)
    per_traj = [rng.normal(size=t.num_tokens).astype(np.float32) for t in trajs]
    packed = per_token_rows(batches, per_traj)
    for b, arr in zip(batches, packed, strict=True):
        assert arr.shape == b.shape and arr.dtype == np.float32
        assert np.all(arr[b.segment_ids == 0] == 0)  # padding stays 0
    for got, want in zip(unpack_per_token(batches, packed, len(trajs)), per_traj, strict=True):
        np.testing.assert_array_equal(got, want)
    again = per_token_rows(batches, unpack_per_token(batches, packed, len(trajs)))
    for a, b in zip(again, packed, strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- the value model
def _random_head(critic: Critic, seed: int) -> tuple[np.ndarray, float]:
    """Give the zero-initialised head random weights (via load_state); returns (w, b)."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(np.asarray, critic.params)
    w = rng.normal(size=params["value_head_d"].shape).astype(np.float32)
    b = np.float32(rng.normal())
    params["value_head_d"] = params["value_head_d"].replace(w)
    params["value_bias"] = params["value_bias"].replace(np.asarray(b))
    critic.load_state(params)
    return w, float(b)


@pytest.mark.devices(4)
def test_values_are_zero_at_init_then_match_transformers_hidden_states(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, arch="qwen2", tie=False, seed=4)
    critic = Critic.from_hf(str(path), OPTIM, mesh=make_mesh("fsdp=2,tensor=2", jax.devices()[:4]),
                            compiler_options=FAST_COMPILE)
    assert "lm_head_dv" not in critic.params["backbone"]  # a critic needs no LM head
    trajs = random_trajectories(2, 9, 20)
    packed = pack_trajectories(trajs, None, seq_len=48, rows_per_micro_batch=2, n_shards=2)
    padded = pack_trajectories(trajs, None, seq_len=20, rows_per_micro_batch=2, n_shards=2,
                               max_segments_per_row=1)
    assert max(b.segment_ids.max() for b in packed) >= 2 and len(padded) > len(packed)
    assert all(np.all(v == 0) for v in critic.compute_values(packed))

    w, b = _random_head(critic, 0)
    got_packed = unpack_per_token(packed, critic.compute_values(packed), len(trajs))
    got_padded = unpack_per_token(padded, critic.compute_values(padded), len(trajs))
    hf = make_hf_model("qwen2", tie=False, seed=4)
    for t, vp, vq in zip(trajs, got_packed, got_padded, strict=True):
        with torch.no_grad():
            out = hf(torch.tensor(t.input_ids[None], dtype=torch.long), output_hidden_states=True)
        hidden_td = out.hidden_states[-1][0].double().numpy()  # after the final norm
        want = np.r_[0.0, (hidden_td @ w + b)[:-1]]  # value of token t from the state at t-1
        # Three fp32 forwards (ours packed, ours padded, transformers) differ by rounding along
        # the network's path, at the scale of the terms the value head adds: Σ|h|·|w| + |b|.
        terms = np.r_[0.0, (np.abs(hidden_td) @ np.abs(w) + abs(b))[:-1]]
        tol = network_tolerance(terms, hf_path_length(hf.config, t.num_tokens))
        assert np.all(np.abs(vp - want) <= tol), np.max(np.abs(vp - want) - tol)
        assert np.all(np.abs(vq - vp) <= tol), np.max(np.abs(vq - vp) - tol)
    for batch, values in zip(packed, critic.compute_values(packed), strict=True):
        starts = batch.positions == 0
        assert np.all(values[starts] == 0) and np.all(values[batch.segment_ids == 0] == 0)


def test_packed_and_padded_batches_give_same_value_loss_and_grads(critic):
    _random_head(critic, 1)
    trajs = random_trajectories(11, 10, 24)
    rng = np.random.default_rng(2)
    returns = [rng.normal(size=t.num_tokens).astype(np.float32) for t in trajs]
    olds = [rng.normal(scale=0.3, size=t.num_tokens).astype(np.float32) for t in trajs]
    results = []
    n_rows = []
    for max_segments in (None, 1):
        batches = pack_trajectories(trajs, None, max_segments_per_row=max_segments, **SHAPE)
        n_rows.append(len(batches))
        results.append(critic.compute_gradients(
            batches, returns=per_token_rows(batches, returns),
            old_values=per_token_rows(batches, olds)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert n_rows[0] < n_rows[1] and loss_a > 0
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        ga, gb = np.asarray(ga), np.asarray(gb)
        # fp32 sums in another order: entries near 0 are compared at the leaf's own scale.
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-6 * np.abs(gb).max())


def test_critic_learns_returns_on_a_fixed_batch(critic):
    trajs = random_trajectories(3, 16, 24)
    batches = pack_trajectories(trajs, None, n_minibatches=2, **SHAPE)
    losses, errors = [], []
    for _ in range(15):
        targets = critic.gae_targets(batches, trajs, gamma=1.0, lam=1.0)
        metrics = critic.train_step(batches, returns=targets.returns,
                                    old_values=targets.old_values)
        losses.append(metrics["value_loss"])
        errors.append(metrics["value_abs_error"])
    assert metrics["n_minibatches"] == 2 and metrics["skipped_steps"] == 0
    assert metrics["n_loss_tokens"] == sum(t.num_generated for t in trajs)
    assert losses[-1] < 0.25 * losses[0], losses
    assert errors[-1] < 0.5 * errors[0], errors
    assert metrics["explained_variance"] > 0.5, metrics
    # With gamma = lam = 1 the returns are each trajectory's reward; the values approach it.
    values = unpack_per_token(batches, critic.compute_values(batches), len(trajs))
    rewards = np.array([t.reward for t in trajs])
    mean_values = np.array([v[t.loss_mask == 1].mean() for t, v in zip(trajs, values, strict=True)])
    assert np.corrcoef(rewards, mean_values)[0, 1] > 0.8
    # Much closer than the best constant prediction (the mean reward) could be.
    assert np.abs(mean_values - rewards).mean() < 0.5 * np.abs(rewards - rewards.mean()).mean()
    # gae_targets put advantages on the loss tokens only (of the micro-batches it returns).
    for b in targets.micro_batches:
        advantages = np.asarray(b.advantages)
        assert np.all(advantages[b.loss_mask == 0] == 0)
        assert np.any(advantages[b.loss_mask == 1] != 0)


def test_gae_targets_on_device_match_the_loop_over_each_trajectory(critic):
    """The PPO path: the critic's values, GAE on the packed rows and the normalisation over
    all micro-batches, all on device, against the float64 loop over each trajectory's loss
    tokens with the same values."""
    _random_head(critic, 3)
    trajs = multi_turn_trajectories(5, 24)
    batches = pack_trajectories(trajs, None, n_minibatches=2, **SHAPE)
    assert len(batches) >= 3 and max(b.segment_ids.max() for b in batches) >= 2
    rewards = np.random.default_rng(6).normal(size=len(trajs))
    targets = critic.gae_targets(batches, trajs, gamma=0.97, lam=0.9, rewards=rewards)
    assert all(isinstance(b.advantages, jax.Array) for b in targets.micro_batches)
    values = unpack_per_token(batches, critic.compute_values(batches), len(trajs))
    for got, want in zip(targets.old_values, critic.compute_values(batches), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # the same program's values
    adv = unpack_per_token(batches, [np.asarray(b.advantages) for b in targets.micro_batches],
                           len(trajs))
    ret = unpack_per_token(batches, [np.asarray(r) for r in targets.returns], len(trajs))
    raw, raw_tol = [], []
    for i, t in enumerate(trajs):
        want_adv, want_ret = gae_reference(t, values[i], rewards[i], 0.97, 0.9)
        adv_tol, ret_tol = gae_tolerance(t, values[i], rewards[i], 0.97, 0.9)
        assert np.all(np.abs(ret[i] - want_ret) <= ret_tol), f"traj {i}"
        raw.append(want_adv)
        raw_tol.append(adv_tol)
    mask = np.concatenate([t.loss_mask for t in trajs]) == 1
    flat_raw = np.concatenate(raw)[mask]
    std = flat_raw.std() + 1e-5
    # The fp32 raw advantages' own error, scaled by 1/std, plus the normalisation's
    # (the mean and variance sums over the loss tokens, ~10 operations a term).
    tol = (np.concatenate(raw_tol)[mask] / std
           + reference_tolerance((np.abs(flat_raw) + np.abs(flat_raw).mean()) / std,
                                 mask.sum(), ops=10))
    assert np.all(np.abs(np.concatenate(adv)[mask] - (flat_raw - flat_raw.mean()) / std) <= tol)
    assert np.all(np.concatenate(adv)[~mask] == 0) and np.all(np.concatenate(ret)[~mask] == 0)


def test_gae_targets_bootstrap_truncated_trajectories_from_the_next_state_value(critic):
    """A trajectory cut at the length limit (finish reason length) is bootstrapped from the
    critic's value of the state after its last token: the value the critic gives a token
    appended to it (the float64 loop then starts from that value instead of 0); a finished
    trajectory's advantages are those of the terminal loop."""
    w, b = _random_head(critic, 4)
    trajs = multi_turn_trajectories(8, 16)
    for t in trajs[::2]:
        t.finish_reason = "length"
    batches = pack_trajectories(trajs, None, **SHAPE)
    assert any(b.truncated.any() for b in batches)
    rewards = np.random.default_rng(9).normal(size=len(trajs))
    targets = critic.gae_targets(batches, trajs, gamma=0.97, lam=0.9, rewards=rewards,
                                 normalize=False)
    values = unpack_per_token(batches, critic.compute_values(batches), len(trajs))
    # V(state after the last token), independently: the value of one more token appended.
    longer = [dataclasses.replace(t, input_ids=np.r_[t.input_ids, 1],
                                  loss_mask=np.r_[t.loss_mask, 0],
                                  behav_logp=np.r_[t.behav_logp, 0],
                                  versions=np.r_[t.versions, -1]) for t in trajs]
    longer_batches = pack_trajectories(longer, None, **SHAPE)
    next_state = [v[-1] for v in unpack_per_token(
        longer_batches, critic.compute_values(longer_batches), len(trajs))]
    adv = unpack_per_token(batches, [np.asarray(b.advantages) for b in targets.micro_batches],
                           len(trajs))
    # V(s_T) computed twice, in two packings: they differ by rounding along the network's
    # path, at the scale of the head's terms, sum_d |h_d| |w_d| <= |h|_2 |w|_2 with the
    # final RMS norm's |h|_2 <= sqrt(d) max|gain|.
    gain = np.abs(np.asarray(jax.tree.leaves(critic.params["backbone"]["final_norm"])[0])).max()
    head_terms = np.sqrt(TINY.hidden_size) * gain * np.linalg.norm(w) + abs(b)
    boot_tol = float(network_tolerance(head_terms, decoder_path_length(
        TINY.hidden_size, TINY.intermediate_size, TINY.hidden_size // TINY.num_attention_heads,
        TINY.num_hidden_layers, SHAPE["seq_len"])))
    for i, t in enumerate(trajs):
        boot = float(next_state[i]) if t.truncated else 0.0
        # r_last + gamma V(s_T) on the last loss token: the same as starting the loop from
        # next_value = V(s_T).
        want, _ = gae_reference(t, values[i], rewards[i] + 0.97 * boot, 0.97, 0.9)
        tol, _ = gae_tolerance(t, values[i], abs(rewards[i]) + abs(boot), 0.97, 0.9)
        assert np.all(np.abs(adv[i] - want) <= tol + (boot_tol if t.truncated else 0.0)), i
    assert any(abs(v) > 1e-3 for v in next_state)  # the bootstrap values are not all 0


def test_gae_targets_leave_the_batch_passed_in_as_it_was(critic):
    """No micro-batch is changed in place: new ones carry the advantages and share every
    other array with the ones passed in; the policy and the critic train on them."""
    _random_head(critic, 4)
    trajs = multi_turn_trajectories(8, 10)
    batches = pack_trajectories(trajs, [0.25] * len(trajs), n_minibatches=2, **SHAPE)
    before = copy.deepcopy(batches)
    targets = critic.gae_targets(batches, trajs, gamma=1.0, lam=0.95)
    for b, b0, new in zip(batches, before, targets.micro_batches, strict=True):
        assert new is not b and b.prox_logp is None and b.ref_logp is None
        assert b.arrays().keys() == b0.arrays().keys()
        for key, value in b0.arrays().items():
            np.testing.assert_array_equal(b[key], value, err_msg=key)
        assert isinstance(b.advantages, np.ndarray)
        assert (b.placements, b.minibatch_id, b.minibatch_loss_tokens, b.n_shards) == (
            new.placements, new.minibatch_id, new.minibatch_loss_tokens, new.n_shards)
        for key in PACKED_FIELDS.keys() - {"advantages"}:
            assert new[key] is b[key], key
        assert not np.array_equal(np.asarray(new.advantages), b.advantages)
    metrics = critic.train_step(targets.micro_batches, returns=targets.returns,
                                old_values=targets.old_values)
    assert metrics["skipped_steps"] == 0 and metrics["value_loss"] > 0
    # The policy takes the device advantages as they are: the same loss and gradients as
    # from host copies of them.
    learner = make_learner(one_device(), compiler_options=FAST_COMPILE,
                           algo=AlgoConfig(ppo_n_minibatches=2))
    on_host = [dataclasses.replace(b, advantages=np.asarray(b.advantages))
               for b in targets.micro_batches]
    (loss_d, grads_d), (loss_h, grads_h) = (learner.compute_gradients(mbs)
                                            for mbs in (targets.micro_batches, on_host))
    assert loss_d == loss_h
    for gd, gh in zip(jax.tree.leaves(grads_d), jax.tree.leaves(grads_h), strict=True):
        np.testing.assert_array_equal(np.asarray(gd), np.asarray(gh))
    for b, b0 in zip(batches, before, strict=True):
        for key, value in b0.arrays().items():
            np.testing.assert_array_equal(b[key], value, err_msg=key)


@pytest.mark.devices(8)
@pytest.mark.slow  # SPMD compiles for 8 devices; the learner tests cover the shared machinery
def test_mesh_training_matches_one_device():
    trajs = random_trajectories(8, 16, 24)
    batches = pack_trajectories(trajs, None, seq_len=32, rows_per_micro_batch=8, n_shards=8)
    rng = np.random.default_rng(0)
    returns = per_token_rows(batches, [rng.normal(size=t.num_tokens) for t in trajs])
    runs = []
    for mesh in (one_device(), make_mesh("fsdp=4,tensor=2")):
        critic = make_critic(mesh)
        metrics = [critic.train_step(batches, returns=returns) for _ in range(2)]
        runs.append((metrics, critic.compute_values(batches)))
    (m_one, v_one), (m_mesh, v_mesh) = runs
    for a, b in zip(m_one, m_mesh, strict=True):
        for key in ("value_loss", "grad_norm", "value_clip_frac", "returns_mean"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
        # Explained variance is 1 - Var(R - V) / Var(R); compare the ratio itself.
        np.testing.assert_allclose(1 - a["explained_variance"], 1 - b["explained_variance"],
                                   rtol=1e-5)
    assert m_one[1]["value_loss"] < m_one[0]["value_loss"]
    for a, b in zip(v_one, v_mesh, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trip_restores_values_and_optimizer(tmp_path, critic):
    trajs = random_trajectories(4, 8, 20)
    batches = pack_trajectories(trajs, None, n_minibatches=2, **SHAPE)
    returns = per_token_rows(batches, [np.full(t.num_tokens, t.reward) for t in trajs])
    critic.train_step(batches, returns=returns)
    saved_values = critic.compute_values(batches)
    st = critic.state_dict()
    with TrainCheckpointer(tmp_path / "critic", async_save=False) as ckpt:
        ckpt.save(st["version"], st["params"], st["opt_state"],
                  CheckpointMeta(version=st["version"]))
        critic.train_step(batches, returns=returns)  # moves away from the saved state
        after_one_more = critic.train_step(batches, returns=returns)
        assert not np.allclose(critic.compute_values(batches)[0], saved_values[0])
        st = critic.state_dict()
        params, opt_state, meta = ckpt.restore(params_target=st["params"],
                                               opt_state_target=st["opt_state"])
    critic.load_state(params, opt_state, step=meta.step, version=meta.version)
    for a, b in zip(critic.compute_values(batches), saved_values, strict=True):
        np.testing.assert_array_equal(a, b)
    critic.train_step(batches, returns=returns)  # same AdamW moments -> same next step
    again = critic.train_step(batches, returns=returns)
    np.testing.assert_allclose(again["value_loss"], after_one_more["value_loss"], rtol=1e-6)
    assert critic.version == 3


# ----------------------------------------------------------------------------- bad input
def test_bad_input_gets_clear_errors(critic):
    trajs = random_trajectories(6, 4, 16)
    batches = pack_trajectories(trajs, None, n_minibatches=2, **SHAPE)
    shape = batches[0].shape
    good = [np.zeros(b.shape, np.float32) for b in batches]
    with pytest.raises(ValueError, match="needs returns="):
        critic.train_step(batches)
    with pytest.raises(ValueError, match=r"micro-batch 0: returns has shape \(4, 31\)"):
        critic.train_step(batches, returns=[np.zeros((shape[0], shape[1] - 1))] + good[1:])
    with pytest.raises(ValueError, match="got 4 old_values arrays for 2 micro-batches"):
        critic.train_step(batches, returns=good, old_values=good + good)
    with pytest.raises(ValueError, match="micro-batch 1: returns has non-finite"):
        critic.train_step(batches, returns=[good[0], np.full(shape, np.nan)])
    assert not hasattr(critic, "compute_logp")  # a value model has no token logprobs
    assert critic.step == 0  # nothing was applied

    rewards = np.zeros(len(trajs))
    with pytest.raises(ValueError, match=r"micro-batch 1: values has shape \(4, 31\), "
                                         r"expected \(4, 32\)"):
        packed_gae_targets(batches, good[:1] + [np.zeros((4, 31))], rewards, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="got 1 value arrays for 2 micro-batches"):
        packed_gae_targets(batches, good[:1], rewards, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"gamma=1.5; expected a number in \[0, 1\]"):
        packed_gae_targets(batches, good, rewards, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="reward of trajectory 1 is nan"):
        packed_gae_targets(batches, good, [0.0, np.nan, 0.0, 0.0], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"trajectories \[4\] are in none of the micro-batches"):
        packed_gae_targets(batches, good, np.zeros(5), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"a micro-batch holds trajectory 3 but there are 3"):
        packed_gae_targets(batches, good, np.zeros(3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"gae_targets: rewards has shape \(3,\); expected "
                                         r"\(4,\), one per trajectory"):
        critic.gae_targets(batches, trajs, gamma=1.0, lam=1.0, rewards=[0.0, 0.0, 0.0])
    nan_values = [np.where(b.segment_ids > 0, np.nan, 0.0) for b in batches]
    with pytest.raises(ValueError, match="the values of micro-batch 0 are not all finite"):
        packed_gae_targets(batches, nan_values, rewards, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="micro-batch 1: old_values has non-finite entries"):
        targets = critic.gae_targets(batches, trajs, gamma=1.0, lam=1.0)
        critic.train_step(batches, returns=targets.returns,
                          old_values=[targets.old_values[0], targets.old_values[1] * np.nan])
    assert critic.step == 0  # nothing was applied
    with pytest.raises(ValueError, match="value_eps_clip must be > 0"):
        make_critic(value_eps_clip=0.0)
    with pytest.raises(TypeError, match="must be a model_defs.CausalLM"):
        Critic(object(), TINY, OPTIM)


def test_value_step_metrics_are_one_typed_table():
    """The critic's metrics come from ValueSums finalised once (losses.step_metrics): the
    names a row shows as train/critic_<name>, in order, and the means and explained
    variance over the minibatches' sums."""
    from areal_jax.losses.step_metrics import (
        ValueStepMetrics,
        ValueSums,
        critic_entries,
        finalise_value_step,
        row_entries,
    )

    names = [f.name for f in dataclasses.fields(ValueStepMetrics)]
    assert names == ["value_loss", "value_clip_frac", "value_mean", "value_abs_error",
                     "returns_mean", "explained_variance", "grad_norm", "grad_norm_max",
                     "n_tokens", "n_loss_tokens", "n_minibatches", "skipped_steps", "lr"]
    one = ValueSums(*np.float32([0.5, 4, 6, 1, 2, 3, 4, 6, 1, 2]))
    two = ValueSums(*np.float32([0.25, 4, 5, 0, 2, 1, 0, 2, 1, 2]))
    assert one.add(ValueSums.zeros()) == one
    m = finalise_value_step([one, two], [1.0, 3.0], [True, False], 0.1)
    assert (m.value_loss, m.value_clip_frac, m.value_mean, m.value_abs_error) == (
        0.375, 1 / 8, 4 / 8, 4 / 8)
    returns_var, error_var = 8 / 8 - (4 / 8) ** 2, 4 / 8 - (2 / 8) ** 2
    assert m.returns_mean == 0.5 and m.explained_variance == 1 - error_var / returns_var
    assert (m.grad_norm, m.grad_norm_max, m.n_tokens, m.n_loss_tokens) == (2.0, 3.0, 11, 8)
    assert (m.n_minibatches, m.skipped_steps, m.lr) == (2, 1, 0.1)
    assert list(row_entries(critic_entries(m.as_dict()))) == [
        f"train/critic_{n}" for n in names]
