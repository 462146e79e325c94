"""Tensor- and data-parallel sharding on 4 host CPU devices (conftest sets
--xla_force_host_platform_device_count=4): same tokens as one device, weights and cache
really split, and no weight- or cache-sized collective in a decode step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from degs_jax.decoders import decode
from degs_jax.generation import Proposal, SamplerSpec, generate, prefill
from degs_jax.lens import LensConfig
from degs_jax.mcmc import MCMCConfig, mh_steps
from degs_jax.models import TransformerLM
from degs_jax.models import forward, init_params, load
from degs_jax.models.sharding import (CACHE, make_mesh, param_shardings, param_specs,
                                      parse_mesh, shard_params)
from tiny_models import tiny_config
from test_loading import VOCAB, assert_params_equal, write_hf_dir


# Four query and four key/value heads, so that every mesh of 4 devices splits whole heads.
CFG = tiny_config("Qwen2ForCausalLM", num_heads=4, num_kv_heads=4, vocab=VOCAB, hidden=32,
                  head_dim=8, intermediate=48)
MESHES = [(2, 2), (1, 4), (4, 1)]
# Three prompts of different lengths: the batch (and its candidates) divides no data axis.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
EOS = (VOCAB - 1,)


@pytest.fixture(scope="module")
def params():
    # Scale 0.3 gives peaked, varied next-token distributions on this tiny model.
    return init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


def _decode(params, method, **hp):
    r = decode(TransformerLM(CFG), params, PROMPTS, method, jax.random.key(7), eos_ids=EOS, **hp)
    return ([[list(c.tokens) for c in o.candidates] for o in r.outputs],
            np.array([[c.log_p for c in o.candidates] for o in r.outputs]),
            [[c.acceptance for c in o.candidates] for o in r.outputs])


DECODES = {
    "temperature": dict(max_new_tokens=24),
    "best_of_n": dict(n=3, max_new_tokens=16),
    "degs_mcmc": dict(block_len=6, num_blocks=3, mh_steps=3, n_chains=2, lsub=(1, 2)),
}


@pytest.mark.parametrize("method", list(DECODES))
def test_sharded_decode_gives_the_same_tokens(params, method):
    want_tokens, want_logp, want_acc = _decode(params, method, **DECODES[method])
    for data, model in MESHES:
        mesh = make_mesh(data, model)
        with jax.set_mesh(mesh):
            tokens, logp, acc = _decode(shard_params(params, CFG, mesh), method, **DECODES[method])
        assert tokens == want_tokens, (data, model)
        assert acc == want_acc, (data, model)
        # Row-parallel layers sum their partial products in another order (fp32): the
        # per-token log-probabilities agree to a few ulps of their ~1-10 magnitude.
        np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-4)


def test_session_has_four_host_devices():
    # conftest.py sets the flag; without it every mesh test here would fail to build its mesh.
    assert jax.device_count() >= 4, "XLA_FLAGS lost --xla_force_host_platform_device_count=4"


def test_sharded_forward_matches_logits_and_lens(params):
    tokens = jnp.asarray(np.arange(3 * 9).reshape(3, 9) % (VOCAB - 1), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (3, 9))
    want = forward(params, CFG, tokens, positions, lens_layers=(1, 2, 3))
    for data, model in MESHES:
        mesh = make_mesh(data, model)
        with jax.set_mesh(mesh):
            got = forward(shard_params(params, CFG, mesh), CFG, tokens, positions, lens_layers=(1, 2, 3))
        # fp32 with a different reduction order in the row-parallel matmuls: ~1e-6 here.
        np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got.lens.entropy, want.lens.entropy, atol=1e-5)
        np.testing.assert_array_equal(got.lens.top1, want.lens.top1)


def test_weights_and_cache_are_split(params):
    mesh = make_mesh(2, 2)
    sharded = shard_params(params, CFG, mesh)
    layer = sharded.layers[0]
    D, F = CFG.hidden_size, CFG.intermediate_size
    hd = CFG.num_heads * CFG.head_dim
    # Each device holds half of every column- or row-parallel weight.
    assert layer.q.addressable_shards[0].data.shape == (D, hd // 2)
    assert layer.k.addressable_shards[0].data.shape == (D, CFG.num_kv_heads * CFG.head_dim // 2)
    assert layer.v_bias.addressable_shards[0].data.shape == (CFG.num_kv_heads * CFG.head_dim // 2,)
    assert layer.o.addressable_shards[0].data.shape == (hd // 2, D)
    assert layer.gate.addressable_shards[0].data.shape == (D, F // 2)
    assert layer.down.addressable_shards[0].data.shape == (F // 2, D)
    assert sharded.embed.addressable_shards[0].data.shape == (VOCAB // 2, D)
    assert layer.attn_norm.addressable_shards[0].data.shape == (D,)
    # Drawing random weights straight into their shards gives the same values.
    drawn = init_params(CFG, jax.random.key(0), jnp.float32, scale=0.3,
                        shardings=param_shardings(CFG, mesh))
    assert_params_equal(drawn, params)
    assert drawn.layers[1].down.sharding.is_equivalent_to(sharded.layers[1].down.sharding, 2)
    with jax.set_mesh(mesh):
        prompts = jnp.ones((4, 8), jnp.int32)
        state = prefill(TransformerLM(CFG), sharded, prompts, jnp.full((4,), 5, jnp.int32), 32, jnp.float32)
    assert state.cache.k.sharding.is_equivalent_to(NamedSharding(mesh, CACHE), state.cache.k.ndim)
    L, B, Hkv, S, Dh = state.cache.k.shape
    assert state.cache.k.addressable_shards[0].data.shape == (L, B // 2, Hkv // 2, S, Dh)
    assert state.cache.v.addressable_shards[0].data.shape == (L, B // 2, Hkv // 2, Dh, S)


def _collective_sizes(hlo: str) -> list[tuple[str, int]]:
    """(op, elements) of every cross-device collective in compiled HLO text."""
    sizes = []
    for m in re.finditer(r"= \(?([a-z0-9]+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|all-to-all|"
                         r"collective-permute|reduce-scatter)(?:-start)?\(", hlo):
        dims = [int(d) for d in m.group(2).split(",") if d]
        sizes.append((m.group(3), int(np.prod(dims)) if dims else 1))
    return sizes


def test_decode_step_and_mh_steps_move_no_weights_or_cache():
    # Wide enough that weights and cache dwarf a step's activations (B x D, B x V).
    cfg = tiny_config("Qwen2ForCausalLM", num_heads=4, num_kv_heads=2, vocab=96, hidden=128,
                      head_dim=32, intermediate=256, layers=2)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    mesh = make_mesh(2, 2)
    S = 64
    lens = LensConfig(lsub=(1,), tau=0.25)
    mc = MCMCConfig(alpha=4.0, beta=5.0, block_len=8, num_blocks=1, mh_steps=2, lens=lens,
                    eos_ids=(95,))

    def compiled(fn, B):
        with jax.set_mesh(mesh):
            sharded = shard_params(params, cfg, mesh)
            state = prefill(TransformerLM(cfg), sharded, jnp.ones((B, 8), jnp.int32), jnp.full((B,), 5, jnp.int32),
                            S, jnp.float32)
            keys = jax.random.split(jax.random.key(0), B)
            limit = jnp.full((B,), 40, jnp.int32)
            if fn is generate:
                spec = SamplerSpec(Proposal(1.0), eos_ids=(95,), lens=lens)
                return generate.lower(TransformerLM(cfg), sharded, state, limit, keys, spec).compile().as_text()
            return mh_steps.lower(TransformerLM(cfg), sharded, state, keys, jnp.int32(0), jnp.ones((B,), bool),
                                  mc).compile().as_text()

    B = 8
    sizes = _collective_sizes(compiled(generate, B))
    assert any(op == "all-reduce" for op, _ in sizes)  # the row-parallel sums are there
    # Smallest weight shard: k, [128, 2 heads * 32 / 2] = 4096 elements; one layer's cache
    # shard: [B/2, 1, S, 32] = 8192. A decode step's activations are at most B x V = 768.
    assert max(n for _, n in sizes) <= B * cfg.vocab_size, sizes
    # MH steps also copy cache rows between the chain and its proposal, rows.ROWS_PER_COPY (8)
    # at a time: one all-reduce of 8 rows ([2, 8, 1, 64, 32] = 32768 elements per device)
    # where the cache each device holds is [2, 16, 1, 64, 32] at B = 32. A slice of the
    # split batch axis instead would all-gather the whole cache.
    B = 32
    cache_shard = cfg.num_layers * (B // 2) * (cfg.num_kv_heads // 2) * S * cfg.head_dim
    sizes = _collective_sizes(compiled(mh_steps, B))
    assert max(n for _, n in sizes) < cache_shard, sizes


def test_decode_kernel_runs_per_shard():
    """The Pallas decode read under a 2x2 mesh (Pallas' interpreter here; Triton on GPUs)
    runs on each device's own rows and KV heads: the same tokens as one device, and the
    compiled decode step moves no cache (a kernel over the whole cache would all-gather
    it onto every device)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config("Qwen2ForCausalLM", num_heads=4, num_kv_heads=2, vocab=96, hidden=64,
                                          head_dim=16, intermediate=96, layers=2), kv_read="kernel")
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21]]

    def run(weights):
        r = decode(TransformerLM(cfg), weights, prompts, "temperature", jax.random.key(3), eos_ids=(95,),
                   max_new_tokens=12)
        return [list(o.chosen.tokens) for o in r.outputs], np.array([o.chosen.log_p for o in r.outputs])

    want_tokens, want_logp = run(params)
    mesh = make_mesh(2, 2)
    with jax.set_mesh(mesh):
        sharded = shard_params(params, cfg, mesh)
        tokens, logp = run(sharded)
        B, S = 4, 32
        state = prefill(TransformerLM(cfg), sharded, jnp.ones((B, 8), jnp.int32), jnp.full((B,), 5, jnp.int32),
                        S, jnp.float32)
        hlo = generate.lower(TransformerLM(cfg), sharded, state, jnp.full((B,), 20, jnp.int32),
                             jax.random.split(jax.random.key(0), B),
                             SamplerSpec(Proposal(1.0), eos_ids=(95,))).compile().as_text()
    assert tokens == want_tokens
    # fp32; per-device pieces and row-parallel sums change the summation order only
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-4)
    cache_shard = cfg.num_layers * (B // 2) * (cfg.num_kv_heads // 2) * S * cfg.head_dim
    sizes = _collective_sizes(hlo)
    assert sizes and max(n for _, n in sizes) < cache_shard, sizes


def test_load_places_each_tensor_in_its_shards(tmp_path, params):
    write_hf_dir(tmp_path / "m", CFG, params)
    mesh = make_mesh(1, 4)
    got = load(tmp_path / "m", "float32", progress=False, mesh=mesh)
    assert_params_equal(got.params, params)
    specs = param_specs(CFG, 4)
    want = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    have = jax.tree.leaves(got.params)
    assert len(want) == len(have)
    for spec, arr in zip(want, have):
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim)


def test_mesh_errors():
    with pytest.raises(ValueError, match="key/value heads \\(2\\) not divisible by 4"):
        param_specs(tiny_config(num_heads=4, num_kv_heads=2), 4)
    with pytest.raises(ValueError, match="needs 8 devices; 4 are available"):
        make_mesh(2, 4)
    assert parse_mesh("2x2") == (2, 2) and parse_mesh("1X4") == (1, 4)
    for bad in ("4", "2x", "0x4", "axb"):
        with pytest.raises(ValueError, match="DATAxMODEL|positive"):
            parse_mesh(bad)
    # A vocabulary that does not split evenly is replicated rather than refused.
    odd = tiny_config(num_heads=4, num_kv_heads=4, vocab=97)
    assert param_specs(odd, 4).embed == P()
    assert param_shardings(CFG, make_mesh(1, 4)).embed.spec == P("model", None)


def test_a_refilled_stream_and_its_tail_give_the_same_tokens_on_a_mesh(params, monkeypatch):
    """Three prompts through two refilled slots on a (2, 2) mesh, the tail gathered into one
    slot (tail_fraction 1/2): the tokens and acceptances of one device, unsharded."""
    from degs_jax import decoders

    gathers = []
    real_gather = decoders.gather_slots
    monkeypatch.setattr(decoders, "gather_slots", lambda carry, slots, n: gathers.append(len(slots)) or
                        real_gather(carry, slots, n))
    keys = jnp.stack([jax.random.key(20 + i) for i in range(len(PROMPTS))])
    settings = dict(DECODES["degs_mcmc"], n_chains=1)

    def run(weights):
        r = decode(TransformerLM(CFG), weights, PROMPTS, "degs_mcmc", keys=keys, eos_ids=EOS, slots=2,
                   tail_fraction=1 / 2, **settings)
        return [list(o.chosen.tokens) for o in r.outputs], [o.chosen.acceptance for o in r.outputs]

    want = run(params)
    mesh = make_mesh(2, 2)
    with jax.set_mesh(mesh):
        assert run(shard_params(params, CFG, mesh)) == want
    assert gathers == [1, 1], gathers  # the tail gathered, unsharded and sharded
