"""Lens tests on tiny random models (fast, CPU): streamed entropy vs a naive full
softmax, collapse depth and D(x) by hand, validation, trajectories and the plot."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_models import tiny_config

from degs_jax import lens, scoring
from degs_jax.models import TransformerLM
from degs_jax.models import forward, init_params, rms_norm, streamed_head
from degs_jax.plots import plot_entropy_trajectories


def naive_lens(h: np.ndarray, w_u: np.ndarray):
    """Reference lens: full [..., V] logits and softmax in float64 numpy.

    h: [..., D] final-normed rows; w_u: [V, D]. Returns (entropy, top1, top1_prob) [...].
    """
    z = h.astype(np.float64) @ w_u.astype(np.float64).T
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    return -(p * logp).sum(-1), z.argmax(-1), p.max(-1)


def sharp_params(cfg, seed=0):
    """fp32 random params with a large unembedding, so lens distributions range from
    near-uniform to near-one-hot (logit spreads of tens of nats stress the running max)."""
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype=jnp.float32, scale=0.3)
    if cfg.tie_word_embeddings:
        return params.__class__(embed=params.embed * 2.0, layers=params.layers,
                                final_norm=params.final_norm, lm_head=None)
    return params.__class__(embed=params.embed, layers=params.layers,
                            final_norm=params.final_norm, lm_head=params.lm_head * 2.0)


def tokens_positions(cfg, B=2, T=6, seed=1):
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens.astype(jnp.int32), positions


# ---------------------------------------------------------------- streamed entropy


@pytest.mark.parametrize("arch, tie, chunk", [
    # 97 = 13 * 7 + 6: full chunks plus a remainder; exactly V: one full chunk; 8192 > V:
    # only the short remainder chunk.
    *[("Qwen2ForCausalLM", tie, chunk) for tie in (False, True) for chunk in (7, 97, 8192)],
    ("LlamaForCausalLM", False, 7), ("LlamaForCausalLM", True, 7)])
def test_streamed_entropy_matches_naive_softmax(arch, tie, chunk):
    cfg = tiny_config(arch, tie=tie, vocab=97)
    params = sharp_params(cfg)
    tokens, positions = tokens_positions(cfg)
    layers = tuple(range(cfg.num_layers + 1))
    out = forward(params, cfg, tokens, positions, capture=layers, lens_layers=layers, lens_chunk=chunk)
    normed = np.asarray(rms_norm(out.residuals, params.final_norm, cfg.rms_norm_eps))
    ent, top1, ptop = naive_lens(normed, np.asarray(params.unembedding()))
    assert out.lens.entropy.dtype == jnp.float32 and out.lens.entropy.shape == ent.shape
    # the test is only meaningful if the distributions span sharp and flat ones
    assert ent.min() < 0.5 and ent.max() > 2.5
    np.testing.assert_allclose(np.asarray(out.lens.entropy), ent, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.lens.top1), top1)
    np.testing.assert_allclose(np.asarray(out.lens.top1_prob), ptop, atol=1e-5, rtol=0)
    # layer_entropies is the same numbers without the [B, T, V] output logits, from another
    # compiled program: fusion and vector width differ by CPU (CI's differed by 3e-6, about
    # 25 float32 ulps at entropy 2), so the naive comparison's tolerance applies
    np.testing.assert_allclose(
        np.asarray(scoring.layer_entropies(TransformerLM(cfg, lens_chunk=chunk), params, tokens, layers)),
        np.asarray(out.lens.entropy), atol=1e-5, rtol=0)


def test_token_stats_in_position_chunks_equals_one_call():
    """`token_stats` over 13 positions in calls of 4 (a scan carrying the KV cache, the last
    call padded) gives the statistics of one call over all 13, up to float summation order
    (cached attention against one uncached pass): log p, H_L and the lens entropies within
    1e-5 nats, d_t equal wherever no probed entropy lies within 1e-4 of tau."""
    cfg = tiny_config("Qwen2ForCausalLM")
    model, params = TransformerLM(cfg), sharp_params(cfg)
    tokens, _ = tokens_positions(cfg, B=2, T=13)
    lcfg = lens.LensConfig(lsub=(1, 2, 3), tau=2.0)
    one, chunked = (jax.device_get(scoring.token_stats(model, params, tokens, lcfg, lcfg.lsub, chunk=chunk))
                    for chunk in (None, 4))
    for field in ("logp", "final_entropy", "layer_entropy"):
        np.testing.assert_allclose(getattr(chunked, field), getattr(one, field), atol=1e-5, rtol=0,
                                   err_msg=field)
    near = (np.abs(one.layer_entropy - lcfg.tau) < 1e-4).any(0)
    assert len(set(one.depth[~near].tolist())) > 1 and near.mean() < 0.5  # the comparison has teeth
    np.testing.assert_array_equal(chunked.depth[~near], one.depth[~near])


def engineered_rows(V=97, spike_height=6.0):
    """Rows of logits [6, V]: the maximum in the first chunk, in the last (remainder)
    chunk and mid-vocabulary; flat; one-hot past exp underflow (H = 0, p_top1 = 1)."""
    ramp = np.linspace(-30.0, 30.0, V)
    spike, onehot = np.zeros(V), np.zeros(V)
    spike[50], onehot[3] = spike_height, 200.0
    return np.stack([ramp, ramp[::-1], spike, np.zeros(V), onehot,
                     np.random.default_rng(0).normal(0, 5, V)]).astype(np.float32)


def identity_head(rows, chunk):
    """streamed_head with W_U = identity, so the lens logits are exactly `rows`.
    (One dummy output row: see test_streamed_head_without_output_rows.)"""
    V = rows.shape[-1]
    return streamed_head(jnp.eye(V, dtype=jnp.float32), jnp.zeros((1, V), jnp.float32),
                         jnp.asarray(rows), chunk)


@pytest.mark.parametrize("chunk", [1, 7, 10, 33, 97, 8192])
def test_streamed_head_engineered_rows(chunk):
    rows = engineered_rows()
    _, ent, top1, ptop, _ = identity_head(rows, chunk)
    ref_ent, ref_top, ref_p = naive_lens(rows, np.eye(rows.shape[-1]))
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(top1), ref_top)
    np.testing.assert_allclose(np.asarray(ptop), ref_p, atol=1e-6, rtol=0)
    assert abs(float(ent[3]) - np.log(rows.shape[-1])) < 1e-5


def test_streamed_head_without_output_rows():
    rows = engineered_rows()
    logits, ent, _, _, _ = streamed_head(jnp.eye(97, dtype=jnp.float32), None, jnp.asarray(rows), 7)
    assert logits is None
    np.testing.assert_allclose(np.asarray(ent), naive_lens(rows, np.eye(97))[0], atol=1e-5)


def test_streamed_entropy_accuracy_does_not_scale_with_logit_size():
    # A spike of 12 nats over 96 zeros (H = 0.00766) and the engineered rows shifted by
    # +50 (same entropies): a naive fp32 log-softmax gets both within ~2e-6.
    rows = np.concatenate([engineered_rows(spike_height=12.0), engineered_rows() + 50.0])
    for chunk in (7, 97):
        ent = np.asarray(identity_head(rows, chunk)[1])
        np.testing.assert_allclose(ent, naive_lens(rows, np.eye(97))[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_last_layer_lens_equals_model_output_entropy(tie):
    cfg = tiny_config("Qwen2ForCausalLM", tie=tie, vocab=97)
    params = sharp_params(cfg, seed=3)
    tokens, positions = tokens_positions(cfg, B=3, T=5, seed=4)
    L = cfg.num_layers
    out = forward(params, cfg, tokens, positions, lens_layers=(L,), lens_chunk=7)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    own = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    np.testing.assert_allclose(np.asarray(out.lens.entropy[0]), np.asarray(own), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.lens.top1[0]), np.asarray(jnp.argmax(out.logits, -1)))
    np.testing.assert_allclose(np.asarray(out.lens.top1_prob[0]),
                               np.asarray(jnp.exp(logp).max(-1)), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- collapse depth, D(x)

# Hand-worked example: L = 12, L_sub = (3, 6, 9, 12), tau = 0.25; five tokens, the last
# being EOS (not scored). Rows = probed layers, columns = tokens.
HAND_LSUB, HAND_L, HAND_TAU = (3, 6, 9, 12), 12, 0.25
HAND_H = np.array([
    #  t0    t1    t2   t3    t4 (EOS)
    [2.00, 0.25, 1.0, 3.00, 0.0],  # layer 3
    [0.90, 0.10, 1.0, 0.25, 0.0],  # layer 6
    [0.20, 0.00, 1.0, 0.10, 0.0],  # layer 9
    [0.10, 0.00, 0.3, 0.00, 0.0],  # layer 12 (= H_L)
], np.float32)
# t0: first H <= 0.25 at layer 9; t1: 0.25 <= 0.25 already at layer 3 (equality counts);
# t2: never <= 0.25, so d = L = 12; t3: 0.25 at layer 6; t4 (EOS): 3.
HAND_D_T = np.array([9, 3, 12, 6, 3])
HAND_MASK = np.array([True, True, True, True, False])
# D = (9 + 3 + 12 + 6) / 12 / 4 = 30 / 48 = 0.625; mean H_L = (0.1 + 0 + 0.3 + 0) / 4 = 0.1
HAND_D, HAND_FINAL = 0.625, 0.1


def test_hand_worked_collapse_depth_and_sequence_depth():
    d_t = lens.collapse_depth(jnp.asarray(HAND_H), HAND_LSUB, HAND_L, HAND_TAU)
    assert d_t.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(d_t), HAND_D_T)
    D = lens.sequence_depth(d_t, jnp.asarray(HAND_MASK), HAND_L)
    assert D.dtype == jnp.float32 and D.shape == ()
    assert float(D) == pytest.approx(HAND_D, abs=1e-7)
    final = lens.mean_final_entropy(jnp.asarray(HAND_H[-1]), jnp.asarray(HAND_MASK))
    assert float(final) == pytest.approx(HAND_FINAL, abs=1e-7)


def test_collapse_depth_thresholds():
    H = jnp.asarray(HAND_H)
    # no probed layer under a tiny tau (H = 0 exactly still qualifies, so shift it up)
    assert np.all(np.asarray(lens.collapse_depth(H + 1.0, HAND_LSUB, HAND_L, 0.25)) == HAND_L)
    # a huge tau collapses every token at the first probed layer
    assert np.all(np.asarray(lens.collapse_depth(H, HAND_LSUB, HAND_L, 1e9)) == HAND_LSUB[0])
    # a probe set without L still reports L when nothing collapses
    np.testing.assert_array_equal(
        np.asarray(lens.collapse_depth(H[:2], (3, 6), HAND_L, 0.25)), [12, 3, 12, 6, 3])


def test_empty_and_all_eos_completions_score_zero():
    d_t = jnp.asarray(HAND_D_T)
    none = jnp.zeros(5, bool)  # an all-EOS (or empty) completion: nothing scored
    assert float(lens.sequence_depth(d_t, none, HAND_L)) == 0.0
    assert float(lens.mean_final_entropy(jnp.asarray(HAND_H[-1]), none)) == 0.0


def test_padding_rows_and_vmap_over_masks():
    # Row 0: the hand example. Row 1: the same completion right-padded with garbage
    # depths past its end. Row 2: pure padding. Row 3: prompt tokens masked out.
    d_t = jnp.asarray([[9, 3, 12, 6, 3, 3, 3],
                       [9, 3, 12, 6, 12, 1, 99],
                       [5, 5, 5, 5, 5, 5, 5],
                       [1, 1, 9, 3, 12, 6, 3]])
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0, 0],
                        [1, 1, 1, 1, 0, 0, 0],
                        [0, 0, 0, 0, 0, 0, 0],
                        [0, 0, 1, 1, 1, 1, 0]], bool)
    expect = np.array([HAND_D, HAND_D, 0.0, HAND_D])
    batched = lens.sequence_depth(d_t, mask, HAND_L)
    mapped = jax.vmap(lambda d, m: lens.sequence_depth(d, m, HAND_L))(d_t, mask)
    np.testing.assert_allclose(np.asarray(batched), expect, atol=1e-7)
    np.testing.assert_allclose(np.asarray(mapped), expect, atol=1e-7)
    # collapse_depth under vmap over a batch axis of the entropies
    H = jnp.stack([jnp.asarray(HAND_H), jnp.asarray(HAND_H) + 5.0])  # [2, K, N]
    per_row = jax.vmap(lambda h: lens.collapse_depth(h, HAND_LSUB, HAND_L, HAND_TAU))(H)
    np.testing.assert_array_equal(np.asarray(per_row), [HAND_D_T, [HAND_L] * 5])


def test_jit_with_traced_tau():
    @jax.jit
    def depth_of(h, mask, tau):
        d_t = lens.collapse_depth(h, HAND_LSUB, HAND_L, tau)
        return d_t, lens.sequence_depth(d_t, mask, HAND_L)

    H, mask = jnp.asarray(HAND_H), jnp.asarray(HAND_MASK)
    d_t, D = depth_of(H, mask, jnp.float32(0.25))
    np.testing.assert_array_equal(np.asarray(d_t), HAND_D_T)
    assert float(D) == pytest.approx(HAND_D)
    d_t, _ = depth_of(H, mask, jnp.float32(0.15))  # equalities at 0.25 no longer collapse
    np.testing.assert_array_equal(np.asarray(d_t), [12, 6, 12, 9, 3])
    taus = jnp.asarray([0.15, 0.25, 1e9], jnp.float32)
    sweep = jax.vmap(depth_of, in_axes=(None, None, 0))(H, mask, taus)[0]
    np.testing.assert_array_equal(np.asarray(sweep), [[12, 6, 12, 9, 3], HAND_D_T, [3] * 5])


def test_collapse_depth_from_model_lens():
    cfg = tiny_config("LlamaForCausalLM", vocab=97, layers=4)
    params = sharp_params(cfg, seed=5)
    tokens, _ = tokens_positions(cfg, B=2, T=5, seed=6)
    lcfg = lens.LensConfig.default(cfg.num_layers, tau=1.0)
    H = scoring.layer_entropies(TransformerLM(cfg, lens_chunk=7), params, tokens, lcfg.lsub)  # [K, B, T]
    d_t = np.asarray(lens.collapse_depth(H, lcfg.lsub, cfg.num_layers, lcfg.tau))
    H = np.asarray(H)
    for b in range(2):
        for t in range(5):
            hit = [l for k, l in enumerate(lcfg.lsub) if H[k, b, t] <= lcfg.tau]
            assert d_t[b, t] == (hit[0] if hit else cfg.num_layers)


# ---------------------------------------------------------------- defaults, validation


def test_default_lsub():
    assert lens.default_lsub(28) == (4, 8, 12, 16, 20, 24, 28)
    assert lens.default_lsub(30) == (4, 9, 14, 18, 22, 26, 30)
    assert lens.default_lsub(24) == (3, 7, 10, 14, 17, 21, 24)  # round(j * 24 / 7)
    assert lens.default_lsub(7) == (1, 2, 3, 4, 5, 6, 7)
    assert lens.default_lsub(3) == (1, 2, 3)  # collisions merged, 0 bumped to 1
    for L in range(1, 80):
        assert lens.validate_lsub(lens.default_lsub(L), L)[-1] == L


@pytest.mark.parametrize("lsub, message", [
    ((), "L_sub is empty"),
    ([0, 4], r"L_sub layers \[0\] out of range 1\.\.12"),
    ((4, 13), r"L_sub layers \[13\] out of range 1\.\.12"),
    ((-1,), r"out of range"),
    ((8, 4), "L_sub must be sorted in increasing order"),
    ((4, 4, 8), r"L_sub has duplicated layers \[4\]"),
    ((4, 8.0), "L_sub entries must be integers"),
    (4, "L_sub must be a sequence"),
])
def test_invalid_lsub(lsub, message):
    with pytest.raises(ValueError, match=message):
        lens.validate_lsub(lsub, 12)
    with pytest.raises(ValueError, match=message):
        lens.collapse_depth(jnp.zeros((1, 3)), lsub, 12, 0.25)


@pytest.mark.parametrize("tau", [0.0, -0.25, float("nan"), float("inf"), "x"])
def test_invalid_tau(tau):
    with pytest.raises(ValueError, match="tau must be a positive"):
        lens.validate_tau(tau)
    with pytest.raises(ValueError, match="tau must be a positive"):
        lens.LensConfig(lsub=(1, 2), tau=tau)
    if isinstance(tau, float):
        with pytest.raises(ValueError, match="tau must be a positive"):
            lens.collapse_depth(jnp.zeros((2, 3)), (1, 2), 2, tau)


def test_entropy_shape_mismatch():
    with pytest.raises(ValueError, match=r"expected \[3, \.\.\.\]"):
        lens.collapse_depth(jnp.zeros((2, 5)), (4, 8, 12), 12, 0.25)


def test_lens_config():
    cfg = tiny_config(layers=3)
    a = lens.LensConfig.default(cfg.num_layers)
    assert a == lens.LensConfig(lsub=(1, 2, 3), tau=0.25)
    assert hash(a) == hash(lens.LensConfig(lsub=[1, 2, 3]))  # lists become tuples
    assert a.validate_for(3) is a
    with pytest.raises(ValueError, match=r"out of range 1\.\.2"):
        a.validate_for(2)
    with pytest.raises(ValueError, match="duplicated"):
        lens.LensConfig(lsub=(2, 2))
    with pytest.raises(ValueError, match="lens_chunk must be a positive integer"):
        TransformerLM(cfg, lens_chunk=0)

    # usable as a static argument of a jitted function
    depth = jax.jit(lambda h, lc: lens.collapse_depth(h, lc.lsub, 3, lc.tau), static_argnums=1)
    assert int(depth(jnp.asarray([[1.0], [0.2], [0.0]]), a)[0]) == 2


# ---------------------------------------------------------------- trajectories, plot


def test_entropy_trajectory_matches_direct_and_ignores_padding():
    cfg = tiny_config("Qwen2ForCausalLM", vocab=97, layers=3)
    params = sharp_params(cfg, seed=7)
    rng = np.random.default_rng(8)
    seqs = []
    for n, prompt in [(9, 3), (5, 2), (12, 4), (4, 4)]:  # the last has no scored token
        toks = rng.integers(0, 97, n)
        mask = np.arange(n) >= prompt
        mask[-1] &= n != 12  # pretend the 12-token completion ends in EOS
        seqs.append((toks, mask))
    traj = scoring.entropy_trajectory(TransformerLM(cfg, lens_chunk=7), params, seqs, batch_size=3,
                                      bucket=8)
    np.testing.assert_array_equal(traj.layers, np.arange(cfg.num_layers + 1))
    # direct: each sequence alone, unpadded
    sums, counts = [], []
    for toks, mask in seqs:
        t = jnp.asarray(toks[None], jnp.int32)
        H = np.asarray(scoring.layer_entropies(TransformerLM(cfg), params, t, traj.layers.tolist()))[:, 0]
        sums.append(H[:, mask].sum(-1))
        counts.append(mask.sum())
    sums, counts = np.array(sums), np.array(counts)
    np.testing.assert_array_equal(traj.num_tokens, counts)
    np.testing.assert_allclose(traj.per_sequence[:3], sums[:3] / counts[:3, None], atol=1e-5)
    assert np.all(np.isnan(traj.per_sequence[3]))
    np.testing.assert_allclose(traj.mean, sums.sum(0) / counts.sum(), atol=1e-5)
    # a layer grid and a different batching give the same numbers
    grid = scoring.entropy_trajectory(TransformerLM(cfg), params, seqs, layers=(1, 3), batch_size=1,
                                      bucket=16)
    np.testing.assert_allclose(grid.mean, traj.mean[[1, 3]], atol=1e-5)
    with pytest.raises(ValueError, match=r"subset of 0\.\.3"):
        scoring.entropy_trajectory(TransformerLM(cfg), params, seqs, layers=(4,))


def test_plot_entropy_trajectories(tmp_path):
    curves = {"base (L=4)": (np.arange(5), np.array([4.0, 3.0, 1.0, 0.3, 0.1])),
              "posttrained (L=6)": (np.arange(7), np.array([4.5, 4.4, 4.0, 3.0, 1.5, 0.4, 0.2]))}
    path = plot_entropy_trajectories(curves, tmp_path / "traj.png", "test", tau=0.25)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="equal non-empty 1-D shapes"):
        plot_entropy_trajectories({"x": ([0, 1], [1.0])}, tmp_path / "bad.png")


def test_auto_chunk_matches_streaming_and_single_block():
    """chunk=None picks one block for small probes and streams large ones; both paths
    and an explicit chunk give the same statistics and logits."""
    from degs_jax.models import lens_head

    rows = jnp.asarray(engineered_rows())
    w = jnp.asarray(np.random.default_rng(1).normal(size=(97, 97)).astype(np.float32))
    h_out = rows[:2]
    single = streamed_head(w, h_out, rows, None)
    streamed = streamed_head(w, h_out, rows, 7)
    old = lens_head.SINGLE_BLOCK_MAX_BYTES, lens_head.DEFAULT_LENS_CHUNK
    # Force the streamed path under chunk=None, in chunks smaller than the vocabulary.
    lens_head.SINGLE_BLOCK_MAX_BYTES, lens_head.DEFAULT_LENS_CHUNK = 0, 10
    try:
        forced = streamed_head(w, h_out, rows, None)
        jax.clear_caches()
    finally:
        lens_head.SINGLE_BLOCK_MAX_BYTES, lens_head.DEFAULT_LENS_CHUNK = old
    # The two paths block the 97-term fp32 dot products differently, so each logit may
    # differ by up to twice the classical summation bound B = gamma_K * sum|h||w|
    # (gamma_K = K u / (1 - K u), u = 2^-24; Higham, Accuracy and Stability, 3.1). Here
    # |logits| reach ~400 and sum|h||w| ~1e3: a fixed atol of 1e-5 (5e-8 relative) asked
    # for bitwise-equal rounding, which jax 0.10.2's CPU kernels do not give (1.2e-4 seen).
    # The statistics follow to first order (p = softmax(z), E = expectation under p):
    # logsumexp moves by sum_j p_j d_j <= max B, the entropy by sum_j p_j |z_j - E z| B_j,
    # p_top1 by p_top1 (B_top + sum_j p_j B_j); doubled for higher orders, plus 1e-5 for the
    # fp32 rounding of the streamed recurrences themselves. Top-1 indices must agree.
    K, u = w.shape[1], 2.0 ** -24
    gamma = K * u / (1 - K * u)
    w64, h_out64, lens64 = (np.asarray(x, np.float64) for x in (w, h_out, rows))
    bound = 2 * gamma * (np.abs(h_out64) @ np.abs(w64).T)
    z = lens64 @ w64.T
    B = 2 * gamma * (np.abs(lens64) @ np.abs(w64).T)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    centred = np.abs(z - (p * z).sum(-1, keepdims=True))
    top = z.argmax(-1)
    tol = {1: 2 * (p * centred * B).sum(-1) + 1e-5,  # entropy
           3: 2 * p[np.arange(len(z)), top] * (B[np.arange(len(z)), top] + (p * B).sum(-1)) + 1e-5,
           4: 2 * B.max(-1) + 1e-5}  # logsumexp
    for other in (streamed, forced):
        logits = np.asarray(other[0])
        assert np.abs(logits).max() > 100  # the magnitudes the bound is about
        assert np.all(np.abs(logits - np.asarray(single[0])) <= bound)
        np.testing.assert_array_equal(np.asarray(other[2]), np.asarray(single[2]))
        for i, t in tol.items():
            assert np.all(np.abs(np.asarray(other[i]) - np.asarray(single[i])) <= t), i


# ---------------------------------------------------------------- decode steps: live rows only


def test_lens_row_counts():
    """The static row counts of the live-rows lens: about B/8 apart, multiples of 8, B last."""
    from degs_jax.models.lens_head import _lens_row_counts

    assert _lens_row_counts(16) == (8, 16)
    assert _lens_row_counts(17) == (8, 16, 17)
    assert _lens_row_counts(64) == (8, 16, 24, 32, 40, 48, 56, 64)
    assert _lens_row_counts(100) == (16, 32, 48, 64, 80, 96, 100)
    assert _lens_row_counts(128) == tuple(range(16, 129, 16))


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_decode_step_lens_of_live_rows_only(batch_invariant):
    """A decode step of 20 rows (>= LENS_LIVE_ROWS_MIN_BATCH: the lens runs on the live
    rows only, in a switch over 8, 16 or 20 rows) with 1, 8, 9, 17 or 20 live rows in
    scattered places: every live row's lens statistics and logits are those of the step
    in which all rows are live, and an idle row's (position past the cache) lens
    statistics are NaN / -1, except at the last layer, whose statistics are the output
    rows'. Lens layers out of order check the scatter of each layer's rows."""
    from degs_jax.models import init_cache
    from degs_jax.models.lens_head import LENS_LIVE_ROWS_MIN_BATCH

    cfg = dataclasses.replace(tiny_config("Qwen2ForCausalLM"), batch_invariant=batch_invariant)  # 3 layers
    B, P, S, layers = 20, 6, 12, (2, 3, 1)
    assert B >= LENS_LIVE_ROWS_MIN_BATCH
    params = sharp_params(cfg)
    tokens, positions = tokens_positions(cfg, B=B, T=P)
    cache = forward(params, cfg, tokens, positions, init_cache(cfg, B, S, jnp.float32)).cache
    step = jax.random.randint(jax.random.PRNGKey(3), (B, 1), 0, cfg.vocab_size)

    def run(live):
        # Idle rows sit at the cache's slot count (rounded up under batch-invariant numerics).
        out = forward(params, cfg, step, jnp.where(live, P, cache.max_len)[:, None], cache, lens_layers=layers)
        return (np.asarray(out.logits[:, 0]),
                [np.asarray(x[:, :, 0]) for x in (out.lens.entropy, out.lens.top1, out.lens.top1_prob,
                                                   out.lens.logsumexp)])

    all_logits, all_stats = run(jnp.ones(B, bool))
    assert np.isfinite(all_stats[0]).all()
    # fp32: the head's GEMM has another row count when fewer rows are live, and XLA's CPU
    # dot may block its sums differently (the logits reach ~100 here: 1e-4 is ~1e-6
    # relative). Under batch-invariant numerics the rows run on fixed tiles: bitwise.
    tol = dict(atol=0, rtol=0) if batch_invariant else dict(atol=1e-4, rtol=1e-5)
    rng = np.random.default_rng(0)
    for n_live in (1, 8, 9, 17, 20):
        live = np.zeros(B, bool)
        live[rng.choice(B, n_live, replace=False)] = True
        logits, stats = run(jnp.asarray(live))
        np.testing.assert_allclose(logits[live], all_logits[live], **tol)
        for got, want in zip(stats, all_stats):
            np.testing.assert_allclose(got[:, live], want[:, live], **tol, err_msg=f"{n_live} live rows")
        idle = ~live
        last = layers.index(cfg.num_layers)
        others = [k for k in range(len(layers)) if k != last]
        assert np.isnan(stats[0][others][:, idle]).all() and (stats[1][others][:, idle] == -1).all()
        assert np.isfinite(stats[0][last]).all()


def test_generate_with_idle_rows_matches_the_whole_batch_lens():
    """Greedy generation of 16 rows that stop at different lengths, recording collapse
    depth: the same tokens, depths and log-probabilities with the live-rows lens
    (lens_rows="live", the default) as with the lens of every row ("all")."""
    from degs_jax.generation import Proposal, SamplerSpec, generate, prefill

    cfg = tiny_config("Qwen2ForCausalLM")
    params = sharp_params(cfg)
    B, P = 16, 5
    tokens, _ = tokens_positions(cfg, B=B, T=P, seed=4)
    spec = SamplerSpec(Proposal(0.0), lens=lens.LensConfig.default(cfg.num_layers, lsub=(1, 2, 3), tau=1.0))
    limit = P + 1 + jnp.arange(B, dtype=jnp.int32) % 9  # rows go idle after 1..9 new tokens

    def run(lens_rows):
        lm = TransformerLM(dataclasses.replace(cfg, lens_rows=lens_rows))
        state = prefill(lm, params, tokens, jnp.full((B,), P, jnp.int32), P + 12, jnp.float32)
        out = generate(lm, params, state, limit, jax.vmap(jax.random.PRNGKey)(jnp.arange(B)), spec)
        return tuple(np.asarray(x) for x in (out.tokens, out.depth, out.logp, out.length))

    assert cfg.lens_rows == "live"
    live_rows, whole = run("live"), run("all")
    np.testing.assert_array_equal(live_rows[3], np.asarray(limit))
    np.testing.assert_array_equal(live_rows[0], whole[0])
    np.testing.assert_array_equal(live_rows[1], whole[1])
    depths = np.concatenate([live_rows[1][r, P:live_rows[3][r] - 1] for r in range(B)])
    assert len(set(depths.tolist())) > 1, depths  # tau 1.0 here: the depths are not all alike
    np.testing.assert_allclose(live_rows[2], whole[2], atol=1e-5, rtol=0)
