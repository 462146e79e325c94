"""The tensor table of `models.params` and what is derived from it (shapes, sharding specs,
checkpoint names, the two layer layouts), and the import layering of the models package."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import degs_jax.models as models_package
from degs_jax.models import forward, init_cache, init_params, is_stacked, stack_layers, unstack_layers
from degs_jax.models.checkpoint import hf_tensor_shapes, params_from_hf, params_to_hf
from degs_jax.models.params import (GLOBAL_TENSORS, LAYER_TENSORS, LayerParams, Params, param_shapes)
from degs_jax.models.sharding import param_specs
from tiny_models import TINY_LLAMA3_ROPE, tiny_config

CONFIGS = {
    "qwen2-tied": tiny_config("Qwen2ForCausalLM", tie=True),
    "qwen3-untied": tiny_config("Qwen3ForCausalLM", head_dim=16),
    "llama3": tiny_config("LlamaForCausalLM", num_kv_heads=4, rope_scaling=TINY_LLAMA3_ROPE),
}


def test_table_rows_are_the_pytree_fields_in_order():
    assert [t.field for t in GLOBAL_TENSORS] == [f.name for f in dataclasses.fields(Params) if f.name != "layers"]
    assert [t.field for t in LAYER_TENSORS] == [f.name for f in dataclasses.fields(LayerParams)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_specs_and_hf_names_agree(name):
    cfg = CONFIGS[name]
    is_shape = lambda x: isinstance(x, tuple)
    for stacked in (False, True):
        shapes = param_shapes(cfg, stacked)
        specs = param_specs(cfg, 2, stacked)
        shape_leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
        spec_leaves = treedef.flatten_up_to(specs)  # same structure, same absent tensors
        for shape, spec in zip(shape_leaves, spec_leaves):
            assert spec == P() or len(spec) == len(shape)
        if stacked:
            assert shapes.layers.q == (cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)
            assert specs.layers.q == P(None, None, "model")
    # Every HF tensor is ours transposed or not, and the absent ones have no HF name.
    hf = hf_tensor_shapes(cfg)
    layer = param_shapes(cfg).layers[0]
    assert hf["model.layers.0.self_attn.q_proj.weight"] == layer.q[::-1]
    assert ("lm_head.weight" in hf) == (not cfg.tie_word_embeddings)
    assert ("model.layers.1.self_attn.q_proj.bias" in hf) == cfg.qkv_bias
    assert ("model.layers.2.self_attn.k_norm.weight" in hf) == cfg.qk_norm
    present = sum(x is not None for x in jax.tree.leaves(param_shapes(cfg), is_leaf=is_shape))
    assert len(hf) == present


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layouts_hold_the_same_weights_and_give_the_same_forward(name):
    cfg = CONFIGS[name]
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    stacked = stack_layers(params)
    assert is_stacked(stacked) and not is_stacked(params)
    assert stacked.layers.gate.shape == (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked), params)
    from_hf = params_from_hf(params_to_hf(params, cfg), cfg, jnp.float32, stacked=True)
    jax.tree.map(np.testing.assert_array_equal, from_hf, stacked)
    assert params_to_hf(stacked, cfg).keys() == params_to_hf(params, cfg).keys()

    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    lens = (1, cfg.num_layers)
    outs = [forward(p, cfg, tokens, positions, init_cache(cfg, 2, 16, jnp.float32), capture=(0, 2),
                    lens_layers=lens) for p in (params, stacked)]
    # Same arithmetic in a different program (loop body vs unrolled): fp32 rounding only.
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# The models package, lowest layer first: a module may import only modules before it.
LAYERS = ["hf_import", "config", "params", "sharding", "decode_kernel", "attention", "lens_head", "transformer",
          "causal_lm", "checkpoint", "gguf_io", "loading", "compilation", "__init__"]
# What models/ may import from the rest of degs_jax: the protocol its adapter implements
# (causal_lm.py) and the neutral row tiles it shares with the samplers; nothing of sampling.
OUTSIDE = {"model_api", "tiling"}


def test_models_modules_import_only_lower_layers_and_nothing_of_the_samplers():
    root = Path(models_package.__file__).parent
    assert sorted(p.stem for p in root.glob("*.py")) == sorted(LAYERS)
    for rank, module in enumerate(LAYERS):
        tree = ast.parse((root / f"{module}.py").read_text())
        for node in ast.walk(tree):  # function-level (lazy) imports included
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 2, f"{module} imports from above degs_jax: {ast.unparse(node)}"
                if node.level == 2:  # `from ..x import ...`: degs_jax.x
                    assert node.module in OUTSIDE, f"{module} imports degs_jax.{node.module}"
                elif node.level == 1:  # `from .x import ...`, or `from . import x, y`
                    for target in [node.module] if node.module else [a.name for a in node.names]:
                        assert target in LAYERS[:rank], f"{module} imports {target}, not a lower layer"
                else:
                    assert not (node.module or "").startswith("degs_jax"), ast.unparse(node)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("degs_jax") for a in node.names), ast.unparse(node)
