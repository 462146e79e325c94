"""GRPO trainer (degs_jax.train): the objective against a hand-written NumPy reference,
gradients through the transformer against finite differences, learning on a toy
verifiable task (and not learning with shuffled rewards), bit-identical kill-and-resume,
checkpoints that `load()` reads back and generates from, and data-parallel updates on
the 4 host CPU devices of conftest."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode
from degs_jax.models import TransformerLM
from degs_jax.models import LoadedModel, init_params, load
from degs_jax.models.sharding import make_mesh, shard_params
from degs_jax.models.transformer import forward
from degs_jax.train import (ContainsTokenReward, GRPOConfig, MathReward, Task, group_advantages,
                            grpo_token_loss, gsm8k_train_tasks, step_tasks, token_logprobs,
                            train_grpo, update_step)
from degs_jax.train.checkpoints import latest_checkpoint, restore_checkpoint
from degs_jax.train.data import default_gsm8k_train_path
from degs_jax.train.grpo import make_optimizer
from tiny_models import tiny_config
from degs_jax.examples.byte_tokenizer import byte_tokenizer

# --------------------------------------------------------------------------- the objective


def numpy_grpo(logp, old, ref, rewards, mask, group, eps, beta, scale=True):
    """Hand-written reference in float64: advantages, loss, d loss / d logp, statistics."""
    r = rewards.reshape(-1, group)
    adv = r - r.mean(1, keepdims=True)
    if scale:
        adv = adv / (r.std(1, keepdims=True) + 1e-6)
    adv = adv.reshape(-1)[:, None]
    ratio = np.exp(logp - old)
    lo, hi = 1 - eps, 1 + eps
    surr1, surr2 = ratio * adv, np.clip(ratio, lo, hi) * adv
    n = mask.sum()
    q = ref - logp
    k3 = np.exp(q) - q - 1
    per_token = -np.minimum(surr1, surr2) + beta * k3
    loss = (per_token * mask).sum() / n
    # d/dlogp of -min(surr1, surr2): -ratio·A where the unclipped term is the minimum
    # (inside the band both terms are equal and both carry that slope), 0 where the
    # clipped constant is smaller. d/dlogp of k3 = 1 - exp(q).
    unclipped_active = surr1 <= surr2
    grad = (np.where(unclipped_active, -ratio * adv, 0.0) + beta * (1 - np.exp(q))) * mask / n
    stats = {"kl": (k3 * mask).sum(), "clipped": ((surr2 < surr1) & mask).sum(), "tokens": n}
    return adv[:, 0], loss, grad, stats


@pytest.fixture(scope="module")
def fixed_batch():
    """6 completions (2 prompts x G = 3) of 7 positions, with ratios inside and on both
    sides of the clip band (none at its edges) and completions of different lengths."""
    rng = np.random.default_rng(3)
    B, S = 6, 7
    logp = -rng.uniform(0.1, 3.0, (B, S))
    offsets = rng.choice([-0.9, -0.05, 0.0, 0.1, 0.7], (B, S))  # ratio = exp(-offset)
    old = logp + offsets
    ref = logp + rng.normal(0, 0.3, (B, S))
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    mask = np.zeros((B, S), bool)
    for b, (start, end) in enumerate([(2, 7), (2, 5), (3, 7), (1, 4), (2, 7), (4, 6)]):
        mask[b, start:end] = True
    return logp, old, ref, rewards, mask


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("scale", [True, False])
def test_loss_and_gradient_equal_numpy_reference(fixed_batch, beta, scale):
    logp, old, ref, rewards, mask = fixed_batch
    group, eps = 3, 0.2
    adv_ref, loss_ref, grad_ref, stats_ref = numpy_grpo(logp, old, ref, rewards, mask, group, eps, beta,
                                                        scale)
    adv = group_advantages(jnp.asarray(rewards, jnp.float32), group, scale)
    chex.assert_shape(adv, (6,))
    # fp32 against float64: every quantity is O(1) (rewards in [0, 1], |log p| < 4), so
    # 1e-5 relative is ~100 fp32 ulps.
    np.testing.assert_allclose(np.asarray(adv), adv_ref, rtol=1e-5, atol=1e-6)
    n = jnp.asarray(mask.sum(), jnp.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    def loss_of(lp):
        return grpo_token_loss(lp, f32(old), f32(ref), adv, jnp.asarray(mask), n, eps, beta)

    (loss, stats), grad = jax.value_and_grad(loss_of, has_aux=True)(f32(logp))
    chex.assert_trees_all_equal_shapes(grad, f32(logp))
    np.testing.assert_allclose(float(loss), loss_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), grad_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(stats["kl"]), stats_ref["kl"], rtol=1e-5)
    assert float(stats["clipped"]) == stats_ref["clipped"] > 0
    assert float(stats["tokens"]) == stats_ref["tokens"]
    # The batch really exercises both clipped sides and the unclipped band.
    ratio = np.exp(logp - old)[mask]
    assert (ratio < 0.8).any() and (ratio > 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()


def test_token_level_normalisation_adds_up_over_micro_batches(fixed_batch):
    """Σ of the per-part losses with the whole batch's token count = the whole loss, and
    it is not the per-sequence average (the rows have different lengths)."""
    logp, old, ref, rewards, mask = (jnp.asarray(x, jnp.float32) for x in fixed_batch)
    adv = group_advantages(rewards, 3)
    n = jnp.sum(mask.astype(bool)).astype(jnp.float32)
    whole = grpo_token_loss(logp, old, ref, adv, mask, n, 0.2, 0.05)[0]
    parts = sum(grpo_token_loss(logp[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                n, 0.2, 0.05)[0] for i in (0, 2, 4))
    np.testing.assert_allclose(float(parts), float(whole), rtol=1e-6)
    per_sequence = np.mean([float(grpo_token_loss(logp[i:i + 1], old[i:i + 1], ref[i:i + 1], adv[i:i + 1],
                                                  mask[i:i + 1], jnp.sum(mask[i].astype(bool)), 0.2,
                                                  0.05)[0]) for i in range(6)])
    assert abs(per_sequence - float(whole)) > 1e-3


# --------------------------------------------------------------------------- through the model

FD_CFG = tiny_config(vocab=16, layers=2, hidden=32, head_dim=8, intermediate=48)


@pytest.fixture(scope="module")
def fd_setup():
    params = init_params(FD_CFG, jax.random.key(1), jnp.float32, scale=0.3)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 16, (4, 9)), jnp.int32)
    mask = np.zeros((4, 9), bool)
    mask[:, 3:] = True
    mask[1, 7:] = False
    logp0 = np.asarray(token_logprobs(params, FD_CFG, tokens)[0])
    # Old policy: ratios well inside and well outside the band, so a small step never
    # moves a token across a clip edge (the loss is smooth along the probe directions).
    old = jnp.asarray(logp0 + rng.choice([-0.7, 0.0, 0.05, 0.6], logp0.shape), jnp.float32)
    ref = jnp.asarray(logp0 + rng.normal(0, 0.2, logp0.shape), jnp.float32)
    adv = group_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
    n = jnp.asarray(mask.sum(), jnp.float32)

    def loss(p, remat=False):
        lp = token_logprobs(p, FD_CFG, tokens, remat)[0]
        return grpo_token_loss(lp, old, ref, adv, jnp.asarray(mask), n, 0.2, 0.1)[0]

    return params, loss


def test_gradient_through_transformer_matches_finite_differences(fd_setup):
    """Directional derivatives <∇L, v> (autodiff, fp32) against central differences
    (L(θ + εv) − L(θ − εv)) / 2ε along random unit directions."""
    params, loss = fd_setup
    grad = jax.jit(jax.grad(loss))(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(grad, params)
    value = jax.jit(loss)
    leaves, treedef = jax.tree.flatten(params)
    total = sum(x.size for x in leaves)
    for seed in range(3):
        keys = jax.random.split(jax.random.key(100 + seed), len(leaves))
        v = [jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in v))
        v = jax.tree.unflatten(treedef, [x / norm for x in v])
        ad = float(sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(v))))
        eps = 1e-2
        shifted = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, params, v)
        fd = (float(value(shifted(1.0))) - float(value(shifted(-1.0)))) / (2 * eps)
        # Truncation error O(eps² · L''') ~ 1e-5 here and fp32 rounding of L (~1e-7) / eps
        # ~ 1e-5: a 2% tolerance leaves a wide margin while a wrong term (a missing
        # 1/N, a dropped KL or clip branch) is off by tens of percent or more.
        assert abs(fd - ad) <= 0.02 * abs(ad) + 2e-5, (seed, fd, ad, total)


def test_remat_gives_the_same_loss_and_gradient(fd_setup):
    params, loss = fd_setup
    plain = jax.jit(jax.value_and_grad(loss))(params)
    remat = jax.jit(jax.value_and_grad(lambda p: loss(p, remat=True)))(params)
    # Recomputation fuses differently, so values agree to fp32 rounding of sums of ~1e2
    # terms: gradient entries are up to ~0.1, and 1e-6 absolute is ~1e-5 of that.
    chex.assert_trees_all_close(remat, plain, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- learning

TOY_CFG = tiny_config(vocab=16, layers=2, hidden=32, head_dim=8, intermediate=48)
TOY_TARGET = 3
TOY_CONFIG = GRPOConfig(group_size=8, prompts_per_step=4, max_prompt_len=4, max_new_tokens=6,
                        learning_rate=1e-2, updates_per_step=1, micro_batch=32, remat=False)


def toy_model():
    params = init_params(TOY_CFG, jax.random.key(0), jnp.float32)
    return LoadedModel(cfg=TOY_CFG, params=params, tokenizer=None, source="random", name="tiny")


def toy_tasks():
    rng = np.random.default_rng(0)
    return [Task(id=str(i), prompt_ids=tuple(int(x) for x in rng.integers(0, 15, 4))) for i in range(8)]


class ShuffledReward:
    """The same rewards, permuted across the completions of the step (a fixed function of
    the completions, so the run stays deterministic)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, tasks, completions):
        rewards = self.inner(tasks, completions)
        seed = abs(hash(tuple(map(tuple, completions)))) % 2**32
        return np.random.default_rng(seed).permutation(rewards)

    def __repr__(self):
        return f"Shuffled({self.inner!r})"


def _rewards(run_dir):
    return [json.loads(line)["reward_mean"] for line in (run_dir / "log.jsonl").read_text().splitlines()]


def test_toy_task_reward_rises_and_shuffled_reward_does_not(tmp_path):
    """Reward = the completion contains token 3 (P ≈ 0.4 at the start). With the real
    reward the mean climbs to ~1 within 30 steps; the same run with the rewards permuted
    across completions (no information about which completion earned them) does not
    climb: the policy only drifts, which lowers the reward."""
    steps = 30
    real = train_grpo(toy_model(), tmp_path / "real", TOY_CONFIG, tasks=toy_tasks(),
                      reward_fn=ContainsTokenReward(TOY_TARGET), steps=steps, eos_ids=(), progress=False)
    shuffled = train_grpo(toy_model(), tmp_path / "shuffled", TOY_CONFIG, tasks=toy_tasks(),
                          reward_fn=ShuffledReward(ContainsTokenReward(TOY_TARGET)), steps=steps,
                          eos_ids=(), progress=False)
    assert real["steps_done"] == shuffled["steps_done"] == steps
    r, s = np.array(_rewards(tmp_path / "real")), np.array(_rewards(tmp_path / "shuffled"))
    assert r[0] == s[0]  # step 0: same policy, same rollouts; only the rewards' order differs
    # 32 completions per step: a step's mean reward has sd <= 0.09 under a fixed policy.
    assert r[:3].mean() < 0.6 and r[-5:].mean() >= 0.9, r
    assert r[-5:].mean() - r[:5].mean() >= 0.3, r
    assert s[-5:].mean() <= s[:5].mean() + 0.05, s
    log = [json.loads(line) for line in (tmp_path / "real" / "log.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in log] == list(range(steps))
    assert log[-1]["kl"] > 0 and log[-1]["entropy"] < log[0]["entropy"]
    assert all(rec["clip_fraction"] == 0.0 for rec in log)  # one update per step: ratio = 1


# --------------------------------------------------------------------------- resume, checkpoints

BYTE_CFG = tiny_config(vocab=257, layers=2, hidden=32, head_dim=8, intermediate=48)
RESUME_CONFIG = GRPOConfig(group_size=4, prompts_per_step=4, max_prompt_len=8, max_new_tokens=6,
                           learning_rate=3e-3, warmup_steps=2, kl_coef=0.05, updates_per_step=2,
                           micro_batch=4, remat=True, seed=11)
TIMING = ("seconds", "tokens_per_s", "rollout_tokens_per_s")


class CrashOnCall:
    """The reward of `inner`, except that call number `crash_at` (0-based) raises: a
    crash in the middle of a step, after its rollouts."""

    def __init__(self, inner, crash_at):
        self.inner, self.crash_at, self.calls = inner, crash_at, 0

    def __call__(self, tasks, completions):
        self.calls += 1
        if self.calls - 1 == self.crash_at:
            raise KeyboardInterrupt("simulated kill")
        return self.inner(tasks, completions)

    def __repr__(self):
        return repr(self.inner)


@pytest.fixture(scope="module")
def byte_model():
    tok = byte_tokenizer()
    params = init_params(BYTE_CFG, jax.random.key(2), jnp.float32, scale=0.1)
    return LoadedModel(cfg=BYTE_CFG, params=params, tokenizer=tok, source="random", name="tiny-bytes")


@pytest.fixture(scope="module")
def resumed_runs(byte_model, tmp_path_factory):
    tok = byte_model.tokenizer
    tasks = [Task(id=str(i), prompt_ids=tuple(tok.encode(w))) for i, w in
             enumerate(["2+2=", "3*3=", "what?", "hello", "1+5=", "7-2=", "ok", "go"])]
    reward = ContainsTokenReward(tok.encode("a")[0])
    eos = (tok.eos_token_id,)
    whole, killed = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("killed")
    train_grpo(byte_model, whole, RESUME_CONFIG, tasks=tasks, reward_fn=reward, steps=4,
               eos_ids=eos, checkpoint_every=2, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train_grpo(byte_model, killed, RESUME_CONFIG, tasks=tasks, reward_fn=CrashOnCall(reward, 2),
                   steps=4, eos_ids=eos, checkpoint_every=2, progress=False)
    assert latest_checkpoint(killed).name == "step-00000002"
    resumed = train_grpo(byte_model, killed, RESUME_CONFIG, tasks=tasks, reward_fn=reward, steps=4,
                         eos_ids=eos, checkpoint_every=2, progress=False)
    return whole, killed, resumed


def _read(path):
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


def test_kill_and_resume_is_bit_identical(resumed_runs):
    whole, killed, resumed = resumed_runs
    assert resumed["resumed_from"] == 2 and resumed["steps_done"] == 4
    a, b = latest_checkpoint(whole), latest_checkpoint(killed)
    assert a.name == b.name == "step-00000004"
    wa, wb = _read(a), _read(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].dtype == np.float32
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    assert (a / "optimizer.msgpack").read_bytes() == (b / "optimizer.msgpack").read_bytes()
    # The training actually moved the weights (an untrained copy would also be "equal").
    init = _read_params_of(whole)
    assert any(not np.array_equal(wa[n], init[n]) for n in wa)
    la = [json.loads(x) for x in (whole / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (killed / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == [0, 1, 2, 3]
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
    assert [strip(r) for r in la] == [strip(r) for r in lb]
    assert la[-1]["ratio"] != 1.0  # two updates per step: the second sees ratios != 1
    assert la[0]["learning_rate"] == pytest.approx(RESUME_CONFIG.learning_rate / 2)  # warm-up
    run = json.loads((killed / "run.json").read_text())
    assert len(run["invocations"]) == 2


def _read_params_of(run_dir):
    from degs_jax.models.checkpoint import params_to_hf

    run = json.loads((run_dir / "run.json").read_text())
    assert run["config"]["model"]["name"] == "tiny-bytes"
    params = init_params(BYTE_CFG, jax.random.key(2), jnp.float32, scale=0.1)
    return params_to_hf(params, BYTE_CFG)


def test_checkpoint_loads_through_load_and_generates(resumed_runs, byte_model):
    whole, _, _ = resumed_runs
    ckpt = latest_checkpoint(whole)
    loaded = load(ckpt, dtype="float32", progress=False)
    assert loaded.cfg == BYTE_CFG
    optimizer = make_optimizer(RESUME_CONFIG)
    step, master, opt_state, state = restore_checkpoint(ckpt, BYTE_CFG, optimizer.init(byte_model.params))
    assert step == state["step"] == 4
    chex.assert_trees_all_equal(loaded.params, master)
    chex.assert_trees_all_equal_structs(opt_state, optimizer.init(master))
    tok = loaded.tokenizer
    prompt = tok.encode("2+2=")
    # The reloaded checkpoint is the trained model: its logits equal the trainer's masters'
    # bit for bit (fp32 both sides; no tolerance because nothing is recomputed differently).
    tokens = jnp.asarray([prompt + tok.encode(" 4")], jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    reloaded = forward(loaded.params, loaded.cfg, tokens, positions).logits
    trained = forward(master, BYTE_CFG, tokens, positions).logits
    chex.assert_trees_all_equal(reloaded, trained)
    initial = forward(byte_model.params, BYTE_CFG, tokens, positions).logits
    assert not np.array_equal(np.asarray(trained), np.asarray(initial))  # training moved them
    assert tok.decode(prompt) == "2+2="
    eos = (tok.eos_token_id,)
    got = decode(TransformerLM(loaded.cfg), loaded.params, [prompt], "greedy", jax.random.key(0), eos_ids=eos,
                 max_new_tokens=8, probe=False)
    want = decode(TransformerLM(BYTE_CFG), master, [prompt], "greedy", jax.random.key(0), eos_ids=eos,
                 max_new_tokens=8, probe=False)
    assert got.outputs[0].chosen.tokens == want.outputs[0].chosen.tokens
    assert len(got.outputs[0].chosen.tokens) > 0
    bf16 = load(ckpt, "bfloat16", progress=False)
    assert bf16.params.embed.dtype == jnp.bfloat16
    decode(TransformerLM(bf16.cfg), bf16.params, [prompt], "greedy", jax.random.key(0), eos_ids=eos,
           max_new_tokens=8, probe=False)


def test_resume_refuses_a_different_configuration(resumed_runs, byte_model):
    whole, _, _ = resumed_runs
    tok = byte_model.tokenizer
    tasks = [Task(id="0", prompt_ids=tuple(tok.encode("hi")))]
    other = GRPOConfig(**{**RESUME_CONFIG.__dict__, "learning_rate": 1.0})
    with pytest.raises(ValueError, match="different configuration"):
        train_grpo(byte_model, whole, other, tasks=tasks, reward_fn=ContainsTokenReward(1), steps=5,
                   progress=False)


# --------------------------------------------------------------------------- data parallel

DP_CFG = tiny_config(vocab=16, layers=2, hidden=32, head_dim=8, intermediate=48, num_heads=4,
                     num_kv_heads=2)
# A huge Adam epsilon makes the first update ≈ lr · g / eps, linear in the gradient, so
# the masters' change compares gradients (with a normal eps it is ≈ lr · sign(g)).
DP_CONFIG = GRPOConfig(group_size=4, prompts_per_step=4, max_prompt_len=4, max_new_tokens=4,
                       learning_rate=1.0, adam_eps=1e3, max_grad_norm=0.0, updates_per_step=1,
                       micro_batch=16, kl_coef=0.1, remat=True)


@pytest.mark.parametrize("data,model", [(4, 1), (2, 2)])
def test_data_parallel_update_equals_single_device(data, model):
    params = init_params(DP_CFG, jax.random.key(4), jnp.float32, scale=0.3)
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.integers(0, 16, (16, 10)), jnp.int32)
    mask = jnp.asarray(np.arange(10)[None] >= rng.integers(3, 6, (16, 1)))
    adv = group_advantages(jnp.asarray(rng.integers(0, 2, 16), jnp.float32), 4)
    ref = token_logprobs(params, DP_CFG, tokens)[0] + 0.1
    optimizer = make_optimizer(DP_CONFIG)
    master0 = jax.tree.map(jnp.copy, params)
    want, _, want_m = update_step(jax.tree.map(jnp.copy, params), optimizer.init(params), DP_CFG,
                                  tokens, mask, adv, None, ref, DP_CONFIG, "float32")
    mesh = make_mesh(data, model)
    split = GRPOConfig(**{**DP_CONFIG.__dict__, "micro_batch": 4})  # 4 micro-batches, split rows
    with jax.set_mesh(mesh):
        sharded = shard_params(params, DP_CFG, mesh)
        placements = [x.sharding for x in jax.tree.leaves(sharded)]
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
        put = lambda x: jax.device_put(x, rows)
        got, _, got_m = update_step(sharded, optimizer.init(sharded), DP_CFG, put(tokens), put(mask),
                                    jax.device_put(adv, jax.sharding.NamedSharding(
                                        mesh, jax.sharding.PartitionSpec("data"))),
                                    None, put(ref), split, "float32")
    # The updated masters keep the inference layout (split over "model", whole over "data").
    for x, placed in zip(jax.tree.leaves(got), placements):
        assert x.sharding.is_equivalent_to(placed, x.ndim), (x.sharding, placed)
    # The KL statistic (k3 ≈ q²/2 with q ~ 0.1) is a difference of O(1) terms: fp32
    # rounding of log p (~1e-7) is ~1e-5 of it, hence its looser tolerance.
    for k, rtol in (("loss", 1e-5), ("grad_norm", 1e-5), ("kl", 1e-4), ("entropy", 1e-5), ("tokens", 0)):
        np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=rtol, err_msg=k)
    # Changes ≈ lr·g/eps ~ 1e-6..1e-3: fp32 summation-order differences of the gradient
    # are ~1e-6 relative, the masters' own rounding ~1e-7 absolute.
    delta = lambda p: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                                   p, master0)
    for a, b in zip(jax.tree.leaves(delta(got)), jax.tree.leaves(delta(want))):
        scale = np.abs(b).max()
        assert scale > 0
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-3 * scale + 2e-7)


def test_training_under_a_mesh_matches_one_device(tmp_path):
    """The whole loop on a 2x2 mesh (rows over "data", weights over "model"): same first
    rollouts and rewards as on one device; uneven splits are refused."""
    one = train_grpo(toy_model(), tmp_path / "one", TOY_CONFIG, tasks=toy_tasks(),
                     reward_fn=ContainsTokenReward(TOY_TARGET), steps=1, eos_ids=(), progress=False)
    mesh = make_mesh(2, 2)
    model = toy_model()
    with jax.set_mesh(mesh):
        model = LoadedModel(cfg=model.cfg, params=shard_params(model.params, TOY_CFG, mesh),
                            tokenizer=None, source="random", name="tiny")
        meshed = train_grpo(model, tmp_path / "mesh", TOY_CONFIG, tasks=toy_tasks(),
                            reward_fn=ContainsTokenReward(TOY_TARGET), steps=2, eos_ids=(), mesh=mesh,
                            progress=False)
        with pytest.raises(ValueError, match="divisible by the mesh's data axis"):
            odd = GRPOConfig(**{**TOY_CONFIG.__dict__, "prompts_per_step": 1, "micro_batch": 8})
            train_grpo(model, tmp_path / "odd", odd, tasks=toy_tasks(), reward_fn=ContainsTokenReward(3),
                       steps=1, eos_ids=(), mesh=make_mesh(4, 1), progress=False)
    assert one["steps_done"] == 1 and meshed["steps_done"] == 2
    a = json.loads((tmp_path / "one" / "log.jsonl").read_text().splitlines()[0])
    b = json.loads((tmp_path / "mesh" / "log.jsonl").read_text().splitlines()[0])
    assert a["reward_mean"] == b["reward_mean"] and a["generated_tokens"] == b["generated_tokens"]
    assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)


# --------------------------------------------------------------------------- data, rewards, config


def test_step_tasks_visit_every_task_once_per_epoch():
    tasks = [Task(id=str(i), prompt_ids=(i + 1,)) for i in range(10)]
    stream = [t.id for s in range(5) for t in step_tasks(tasks, s, 4, seed=3)]  # 2 epochs
    assert sorted(stream[:10]) == sorted(stream[10:20]) == sorted(t.id for t in tasks)
    assert stream[:10] != stream[10:20]  # a fresh permutation per epoch
    assert [t.id for t in step_tasks(tasks, 3, 4, seed=3)] == stream[12:16]  # stateless
    assert step_tasks(tasks, 0, 4, seed=4) != step_tasks(tasks, 0, 4, seed=3)


def test_gsm8k_train_tasks_use_the_eval_prompt_and_refuse_the_test_split():
    from degs_jax.eval.benchmarks import default_data_dir
    from degs_jax.eval.prompts import problem_prompt_ids

    tok = byte_tokenizer()
    tasks = gsm8k_train_tasks(tok, limit=20)
    assert len(tasks) == 20 and tasks[0].id == "gsm8k_train/0"
    assert tasks[0].target.answer == "72" and tasks[0].target.benchmark == "gsm8k"
    assert list(tasks[0].prompt_ids) == problem_prompt_ids(tasks[0].target, tok, True)
    assert "\\boxed{}" in tok.decode(list(tasks[0].prompt_ids))
    short = gsm8k_train_tasks(tok, limit=20, max_prompt_len=300)
    assert 0 < len(short) < 20 and all(len(t.prompt_ids) <= 300 for t in short)
    with pytest.raises(ValueError, match="test split"):
        gsm8k_train_tasks(tok, default_data_dir() / "gsm8k_test.jsonl")
    assert default_gsm8k_train_path().name == "gsm8k_train.jsonl"


def test_math_reward_grades_boxed_answers():
    from degs_jax.eval.benchmarks import Problem

    tok = byte_tokenizer()
    task = Task(id="p", prompt_ids=(1,), target=Problem(id="p", benchmark="gsm8k", question="q",
                                                         answer="1000"))
    texts = ["so \\boxed{1000}", "\\boxed{1,000}", "\\boxed{999}", "no box: 1000"]
    with MathReward(tok) as reward:
        got = reward([task] * 4, [tok.encode(t) + [tok.eos_token_id] for t in texts])
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("kw,msg", [
    (dict(group_size=1), "group_size"),
    (dict(prompts_per_step=6, updates_per_step=4), "divisible by updates_per_step"),
    (dict(prompts_per_step=4, group_size=4, updates_per_step=1, micro_batch=5), "micro_batch"),
    (dict(kl_coef=0.1, reference_kl=False), "reference"),
    (dict(clip_eps=1.5), "clip_eps"),
    (dict(temperature=0.0), "temperature"),
])
def test_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GRPOConfig(**{"prompts_per_step": 8, "micro_batch": 4, **kw})


# --------------------------------------------------------------------------- command line


def write_byte_model(directory, seed=6):
    """A tiny random model with the byte tokenizer as an HF directory (context 2048)."""
    import dataclasses

    from safetensors.numpy import save_file

    from degs_jax.models.checkpoint import params_to_hf

    cfg = dataclasses.replace(BYTE_CFG, max_position_embeddings=2048)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    params = init_params(cfg, jax.random.key(seed), jnp.float32, scale=0.1)
    save_file(params_to_hf(params, cfg), str(directory / "model.safetensors"))
    byte_tokenizer().save_pretrained(directory)
    return directory


def test_train_grpo_command_trains_resumes_and_refuses_bad_settings(tmp_path, capsys):
    from degs_jax.cli import main

    model_dir = write_byte_model(tmp_path / "model")
    out = tmp_path / "run"
    argv = ["train-grpo", "--model", str(model_dir), "--out", str(out),
            "--limit", "40", "--max-prompt-len", "320", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--updates-per-step", "1", "--micro-batch", "4",
            "--checkpoint-every", "1", "--no-progress"]
    assert main(argv + ["--steps", "1", "--dtype", "bfloat16"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["steps_done"] == 1 and first["resumed_from"] == 0
    # resumed with the default --dtype auto (float32 on CPU): the run keeps its bfloat16
    assert main(argv + ["--steps", "2"]) == 0
    captured = capsys.readouterr()
    second = json.loads(captured.out.strip().splitlines()[-1])
    assert second["resumed_from"] == 1 and second["steps_done"] == 2
    assert (f"degs: resuming {out} in bfloat16, the dtype it was made with (--dtype auto would "
            "choose float32 here)") in captured.err
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in log)
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["grpo"]["prompts_per_step"] == 2 and len(run["invocations"]) == 2
    assert load(out / "checkpoints" / "step-00000002", progress=False).cfg.vocab_size == 257
    # The trained checkpoint is evaluated by `degs eval` as it is (what the GPU run does).
    checkpoint = out / "checkpoints" / "step-00000002"
    assert main(["eval", "--model", str(checkpoint), "--dtype", "float32", "--benchmark", "gsm8k",
                 "--method", "greedy", "--max-new-tokens", "4", "--limit", "2",
                 "--out", str(tmp_path / "after"), "--no-progress"]) == 0
    capsys.readouterr()
    records = [json.loads(x) for x in (tmp_path / "after" / "results.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1] and all("correct" in r for r in records)
    evaluated = json.loads((tmp_path / "after" / "run.json").read_text())
    assert evaluated["invocations"][0]["model_source"] == str(checkpoint)
    assert main(argv + ["--steps", "3", "--learning-rate", "0.5"]) == 2
    assert "different configuration" in capsys.readouterr().err
    assert main(argv + ["--steps", "3", "--dtype", "float32"]) == 2  # an explicit other dtype
    assert "different configuration (model differ)" in capsys.readouterr().err
    assert main(["train-grpo", "--model", str(model_dir), "--out", str(tmp_path / "x"), "--steps", "1",
                 "--group-size", "1"]) == 2
    assert "group_size must be >= 2" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_run_script_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """bench/grpo_run.py, every phase, on a tiny random model (the CPU stand-in for the
    GPU run): evaluations before/after, GRPO steps, tuned lens, pool, lens comparison."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "grpo_run.py"
    spec = importlib.util.spec_from_file_location("grpo_run", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model_dir = write_byte_model(tmp_path / "model")
    out, copy = tmp_path / "out", tmp_path / "copy"
    argv = ["--preset", "tiny", "--model", str(model_dir), "--out", str(out), "--copy-to", str(copy)]
    assert script.main(argv) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    phases = [r["phase"] for r in records]
    assert phases[-1] == "done", records[-1]
    for phase in ("eval_before", "estimate", "train", "eval_after_step2", "lens", "pool", "compare"):
        assert phase in phases, phase
    assert all("device" in r and "versions" in r and "date" in r for r in records)
    summary = json.loads((copy / "grpo_summary.json").read_text())
    assert set(summary["before"]) == set(summary["after"]) == {"gsm8k", "math500"}
    assert summary["steps"] == 2
    assert (copy / "training_curve.png").stat().st_size > 5000
    lens_rows = [r for r in records if r["phase"] == "compare"]
    assert {r["lens"] for r in lens_rows} == {"logit", "tuned"}
    assert sorted(p.name for p in copy.iterdir()) == ["grpo_log.jsonl", "grpo_run_artifacts.tar.gz",
                                                      "grpo_summary.json", "training_curve.png"]
    # A second call finds everything done.
    assert script.main(argv) == 0
    again = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert again[-1]["phase"] == "done" and "train" not in [r["phase"] for r in again]
