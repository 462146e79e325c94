"""Tuned lens (degs_jax.train.tuned_lens): fitting lowers the KL to the final layer at every
layer while a translator for the final layer stays the identity; `lens="tuned"` changes
d_t and D(x) only through the translated distributions (checked against a direct NumPy
computation), in teacher-forced scoring and during generation alike; saving, loading and
the cache keyed by the weights' fingerprint; the CLI."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from degs_jax.decoders import decode
from degs_jax.lens import LensConfig, collapse_depth
from degs_jax.models import TransformerLM, TunedTransformerLM, with_tuned_lens
from degs_jax.models import LoadedModel, forward, init_params
from degs_jax.scoring import entropy_trajectory, layer_entropies, score_sequences, token_stats
from degs_jax.train.tuned_lens import (TunedLens, TunedLensConfig, default_lens_path, fit_tuned_lens,
                                       identity_lens, lens_fingerprint, lens_kl, load_tuned_lens,
                                       params_fingerprint, resolve_lens, save_tuned_lens)
from tiny_models import tiny_config

CFG = tiny_config(vocab=64, layers=4, hidden=32, head_dim=8, intermediate=48)
L = CFG.num_layers
LM = TransformerLM(CFG)


def tuned(params, lens):
    """The model protocol's (model, params) that probe through `lens`."""
    model, both = with_tuned_lens(LM, params, lens)
    assert isinstance(model, TunedTransformerLM)
    return model, both


@pytest.fixture(scope="module")
def params():
    # Scale 0.5: early layers' logit-lens distributions are far from the output's
    # (KL of several nats), so there is something for the translators to fix.
    return init_params(CFG, jax.random.key(0), jnp.float32, scale=0.5)


@pytest.fixture(scope="module")
def fitted(params):
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, CFG.vocab_size, (80, 16)).astype(np.int32)
    config = TunedLensConfig(layers=tuple(range(L + 1)), steps=60, seq_len=16, batch_size=16,
                             micro_batch=8, heldout=16)
    return fit_tuned_lens(params, CFG, sequences, config, progress=False)


def test_fitting_lowers_kl_at_every_layer_and_leaves_the_final_translator_at_identity(fitted):
    lens, report = fitted
    chex.assert_shape([lens.weight, lens.bias], [(L + 1, 32, 32), (L + 1, 32)])
    before, after = np.array(report["heldout_kl_logit"]), np.array(report["heldout_kl_tuned"])
    # Held-out KL (nats) per layer 0..L-1: every layer improves by at least 20%.
    assert np.all(after[:L] < 0.8 * before[:L]), (before, after)
    assert before[:L].min() > 0.1
    # Layer L's lens is the output itself: KL 0 before, and its translator's gradient is
    # 0 up to rounding, so it stays at the identity while the others move by O(1).
    assert before[L] == pytest.approx(0.0, abs=1e-6) and after[L] == pytest.approx(0.0, abs=1e-5)
    assert float(jnp.abs(lens.weight[L]).max()) < 1e-4 and float(jnp.abs(lens.bias[L]).max()) < 1e-4
    assert float(jnp.abs(lens.weight[0]).max()) > 0.1
    assert report["train_kl_curve"][-1] < report["train_kl_curve"][0]


def test_identity_lens_is_the_logit_lens(params):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    layers = (1, 2, 4)
    plain = layer_entropies(LM, params, tokens, layers)
    ident = layer_entropies(*tuned(params, identity_lens(CFG)), tokens, layers)
    np.testing.assert_array_equal(np.asarray(ident), np.asarray(plain))
    kl = lens_kl(identity_lens(CFG, (0, L)), params, CFG, tokens, 2)
    assert float(kl[1]) == pytest.approx(0.0, abs=1e-6) and float(kl[0]) > 0.1


# --------------------------------------------------------------------------- d_t and D(x)

LSUB = (1, 2, 3, 4)


def random_lens(layers, scale=0.3, seed=3):
    """A non-trivial lens (random translators) so that every lens row changes."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    K = len(layers)
    return TunedLens(layers=tuple(layers), weight=scale * jax.random.normal(k1, (K, 32, 32)),
                     bias=scale * jax.random.normal(k2, (K, 32)))


def numpy_entropies(params, tokens, lens: TunedLens, layers):
    """H_l of softmax(W_U · RMSNorm(h + h·A + b)) in float64 from captured residuals."""
    T = tokens.shape[1]
    out = forward(params, CFG, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), tokens.shape),
                  capture=tuple(layers))
    res = np.asarray(out.residuals, np.float64)  # [K, B, T, D]
    w_u = np.asarray(params.unembedding(), np.float64)
    g = np.asarray(params.final_norm, np.float64)
    index = {l: k for k, l in enumerate(lens.layers)}
    H = []
    for k, l in enumerate(layers):
        h = res[k]
        if l in index:
            h = h + h @ np.asarray(lens.weight[index[l]], np.float64) + np.asarray(lens.bias[index[l]],
                                                                                np.float64)
        h = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + CFG.rms_norm_eps) * g
        z = h @ w_u.T
        z = z - z.max(-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        H.append(-(p * np.log(np.maximum(p, 1e-300))).sum(-1))
    return np.stack(H)


def test_tuned_depth_equals_a_direct_computation(params):
    lens = random_lens(range(L))  # the default layers: 0..L-1, none for L
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 63, 5).tolist(), rng.integers(0, 63, 3).tolist()]
    completions = [rng.integers(0, 63, 9).tolist(), rng.integers(0, 63, 12).tolist()]
    tokens = np.zeros((2, 15), np.int32)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        tokens[r, :len(p) + len(c)] = p + c
    H = numpy_entropies(params, tokens, lens, LSUB)
    H_logit = numpy_entropies(params, tokens, identity_lens(CFG), LSUB)
    # tau between the data's entropies, and no entropy within 1e-3 of it: the direct
    # computation (float64) and ours (fp32, error ~1e-6) cannot disagree on a threshold test.
    tau = float(np.median(H[:3]))
    assert np.abs(H - tau).min() > 1e-3 and np.abs(H_logit - tau).min() > 1e-3
    cfg_lens = LensConfig(lsub=LSUB, tau=tau)
    got_H = layer_entropies(*tuned(params, lens), tokens, LSUB)
    np.testing.assert_allclose(np.asarray(got_H), H, rtol=1e-5, atol=1e-5)
    want_d = np.asarray(collapse_depth(jnp.asarray(H, jnp.float32), LSUB, L, tau))
    logit_d = np.asarray(collapse_depth(jnp.asarray(H_logit, jnp.float32), LSUB, L, tau))
    stats_t = jax.device_get(token_stats(*tuned(params, lens), jnp.asarray(tokens), cfg_lens))
    stats_l = jax.device_get(token_stats(LM, params, jnp.asarray(tokens), cfg_lens))
    logp_t, depth_t, fent_t = stats_t.logp, stats_t.depth, stats_t.final_entropy
    logp_l, depth_l, fent_l = stats_l.logp, stats_l.depth, stats_l.final_entropy
    np.testing.assert_array_equal(depth_t, want_d)
    np.testing.assert_array_equal(depth_l, logit_d)
    assert (depth_t != depth_l).any()  # the lens matters here
    # Only the translated rows change: log p and the final entropy (row L, which this lens
    # does not translate) are the logit lens's.
    np.testing.assert_allclose(logp_t, logp_l, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fent_t, fent_l, rtol=1e-6, atol=1e-6)
    scored = score_sequences(*tuned(params, lens), prompts, completions, cfg_lens, bucket=16)
    plain = score_sequences(LM, params, prompts, completions, cfg_lens, bucket=16)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        span = slice(len(p), len(p) + len(c))
        np.testing.assert_array_equal(scored[r]["token_depth"], want_d[r, span])
        assert scored[r]["depth"] == pytest.approx(want_d[r, span].mean() / L, abs=1e-6)
        assert scored[r]["log_p"] == pytest.approx(plain[r]["log_p"], abs=1e-5)


def test_decoding_with_a_tuned_lens_changes_only_depths(params):
    """Greedy tokens and log p do not depend on the lens; the recorded d_t are the tuned
    lens's (equal to teacher-forced tuned scoring) and differ from the logit lens's."""
    lens = random_lens(range(L))
    prompts = [[3, 9, 27], [5, 1]]
    hp = dict(max_new_tokens=10, lsub=LSUB, tau=2.0)
    with_lens = decode(*tuned(params, lens), prompts, "greedy", jax.random.key(0), eos_ids=(), **hp)
    logit = decode(LM, params, prompts, "greedy", jax.random.key(0), eos_ids=(), **hp)
    ref = score_sequences(*tuned(params, lens), prompts, [o.chosen.tokens for o in with_lens.outputs],
                          LensConfig(lsub=LSUB, tau=2.0))
    differs = False
    for t, g, r in zip(with_lens.outputs, logit.outputs, ref):
        assert t.chosen.tokens == g.chosen.tokens
        assert t.chosen.log_p == pytest.approx(g.chosen.log_p, abs=1e-5)
        assert t.chosen.depth == pytest.approx(r["depth"], abs=1e-6)
        differs |= abs(t.chosen.depth - g.chosen.depth) > 1e-6
    assert differs
    # The MCMC chain probes through the same translators (its D(x) enters the acceptance).
    mc = decode(*tuned(params, lens), prompts[:1], "degs_mcmc", jax.random.key(1), eos_ids=(),
                block_len=4, num_blocks=2, mh_steps=2, lsub=LSUB, tau=2.0)
    c = mc.outputs[0].chosen
    again = score_sequences(*tuned(params, lens), prompts[:1], [c.tokens],
                            LensConfig(lsub=LSUB, tau=2.0))[0]
    assert c.depth == pytest.approx(again["depth"], abs=1e-6)


def test_entropy_trajectory_reads_through_the_tuned_lens(params):
    lens = random_lens(range(L))
    toks = np.arange(12) % 60
    mask = np.zeros(12, bool)
    mask[4:] = True
    traj = entropy_trajectory(*tuned(params, lens), [(toks, mask)], layers=LSUB, bucket=16)
    H = numpy_entropies(params, toks[None].astype(np.int32), lens, LSUB)[:, 0]
    np.testing.assert_allclose(traj.mean, H[:, mask].mean(-1), rtol=1e-5)


# --------------------------------------------------------------------------- storage


def test_save_load_and_the_fingerprint_cache(params, tmp_path):
    lens = random_lens((0, 2))
    fp = params_fingerprint(params)
    assert fp == params_fingerprint(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    moved = jax.tree.map(lambda x: x, params)
    moved.final_norm = params.final_norm + 0.5
    assert params_fingerprint(moved) != fp
    path = save_tuned_lens(lens, default_lens_path(fp), CFG, fp, {"note": "x"})
    back = load_tuned_lens(path, CFG, fp)
    assert back.layers == (0, 2)
    chex.assert_trees_all_equal(back, lens)
    assert lens_fingerprint(back) == lens_fingerprint(lens)
    with pytest.raises(ValueError, match="other weights"):
        load_tuned_lens(path, CFG, "0" * 64)
    model = LoadedModel(cfg=CFG, params=params, tokenizer=None, source="x", name="tiny")
    assert resolve_lens("logit", model) is None
    chex.assert_trees_all_equal(resolve_lens("tuned", model), lens)  # found by fingerprint
    other = LoadedModel(cfg=CFG, params=moved, tokenizer=None, source="x", name="tiny2")
    with pytest.raises(FileNotFoundError, match="degs train-lens"):
        resolve_lens("tuned", other)
    with pytest.raises(ValueError, match="layers"):
        identity_lens(CFG, (2, 1))


# --------------------------------------------------------------------------- CLI


def test_train_lens_and_probe_with_it_on_the_command_line(params, tmp_path, capsys):
    from degs_jax.cli import main
    from test_loading import VOCAB, write_hf_dir  # a tiny HF directory, word-level tokenizer

    cfg = tiny_config(vocab=VOCAB, layers=2, hidden=32, head_dim=8, intermediate=48)
    model_dir = write_hf_dir(tmp_path / "m", cfg, init_params(cfg, jax.random.key(5), jnp.float32,
                                                              scale=0.5))
    argv = ["train-lens", "--model", str(model_dir), "--dtype", "float32", "--steps", "3",
            "--seq-len", "32", "--batch-size", "4", "--micro-batch", "2", "--heldout", "4",
            "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "KL logit lens" in out.out and "saved" in out.err
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "a b", "completion": "c d e"}) + "\n")
    for lens in ("logit", "tuned"):
        assert main(["probe", "--model", str(model_dir), "--dtype", "float32", "--no-chat",
                     "--input", str(rows), "--out", str(tmp_path / lens), "--lens", lens, "--lsub", "1,2"]) == 0
        record = json.loads((tmp_path / lens / "probe.jsonl").read_text())
        assert record["lens"] == lens
    capsys.readouterr()
    assert main(["probe", "--model", str(model_dir), "--input", str(rows), "--out", str(tmp_path / "x"),
                 "--tuned-lens", "nope.safetensors"]) == 2
    assert "--tuned-lens needs --lens tuned" in capsys.readouterr().err
    # A graded candidate pool probed through the tuned lens (recorded in the run's
    # configuration), then D(x)'s predictive statistics under both lenses.
    pool = tmp_path / "pool"
    assert main(["eval", "--model", str(model_dir), "--dtype", "float32", "--no-chat", "--benchmark",
                 "deepmind500", "--method", "best_of_n", "--n", "2", "--limit", "2", "--max-new-tokens",
                 "4", "--lsub", "1,2", "--keep-candidates", "--no-progress", "--lens", "tuned",
                 "--out", str(pool)]) == 0
    config = json.loads((pool / "run.json").read_text())["config"]
    assert config["lens"]["kind"] == "tuned" and len(config["lens"]["sha256"]) == 64
    assert main(["analyze", str(pool), "--lens", "both", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    sweep = json.loads((pool / "lsub_sweep.json").read_text())
    assert [(r["lens"], r["lsub"]) for r in sweep["rows"]] == [("logit", [1, 2]), ("tuned", [1, 2])]
    assert "tuned" in out and "logit" in out
    # Re-scoring under the tuned lens reproduces the D(x) recorded while generating with it.
    records = [json.loads(x) for x in (pool / "results.jsonl").read_text().splitlines()]
    recorded = [c["D"] for r in records for c in r["candidates"]]
    assert sweep["rows"][1]["mean_D"] == pytest.approx(sum(recorded) / len(recorded), abs=1e-6)
