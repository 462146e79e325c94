"""XLA's CPU fusion emitters against its older loop emitters (`--xla_cpu_use_fusion_emitters=false`),
both without LLVM's optimizations (the test suite's FAST_COMPILE, tests/xla_flags.py): the
seconds XLA spends compiling a decoder's programs on a tiny model (what most tests do), and
the seconds a 135M-shape decode runs once compiled (what the real-weight tests and the
notebooks do). Each configuration runs in a process of its own (XLA reads its flags once);
random float32 weights; one JSON line per configuration.

    python bench/loop_emitters.py [--rows 16] [--prompt 24] [--new 48]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Timings here are of compilations as they happen: the library's default persistent cache
# (models/compilation.py) stays off unless a script turns a cache on itself.
os.environ.setdefault("DEGS_JAX_COMPILATION_CACHE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from xla_flags import FAST_COMPILE, decoding_flags  # noqa: E402  (the suite's flags, one home)

CONFIGURATIONS = {"fusion emitters": decoding_flags(" ".join(FAST_COMPILE)),
                  "loop emitters": " ".join(FAST_COMPILE)}


def measure(args) -> dict:
    """In a process whose XLA_FLAGS are the configuration's."""
    import jax
    import jax.monitoring
    import numpy as np

    from common import environment, shape_config
    from degs_jax.decoders import decode
    from degs_jax.models import TransformerLM, init_params

    compiling = [0.0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiling.__setitem__(0, compiling[0] + seconds)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    rng = np.random.default_rng(0)
    record = {}
    for shape, method, settings in (("tiny", "degs_mcmc", dict(block_len=8, num_blocks=2, mh_steps=2)),
                                    ("smollm2-135m", "temperature", dict(max_new_tokens=args.new))):
        cfg = shape_config(shape, max_len=4096)
        lm, params = TransformerLM(cfg), init_params(cfg, jax.random.key(0), np.float32)
        prompts = [list(rng.integers(0, cfg.vocab_size, args.prompt)) for _ in range(args.rows)]
        run = lambda: decode(lm, params, prompts, method, jax.random.key(1), eos_ids=(), **settings)
        compiling[0] = 0.0
        start = time.perf_counter()
        run()
        first, compile_s = time.perf_counter() - start, compiling[0]
        start = time.perf_counter()
        run()
        record[shape] = {"method": method, **settings, "first_call_s": round(first, 2),
                         "compiling_s": round(compile_s, 2),
                         "compiled_call_s": round(time.perf_counter() - start, 2)}
    return {"environment": environment(), **record}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="prompts decoded together")
    ap.add_argument("--prompt", type=int, default=24, help="tokens per prompt (random)")
    ap.add_argument("--new", type=int, default=48, help="new tokens of the 135M-shape decode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    for name, flags in CONFIGURATIONS.items():
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, check=True,
                               capture_output=True, text=True)
        print(json.dumps({"bench": "loop_emitters", "configuration": name, "XLA_FLAGS": flags,
                          "command": " ".join(["python", *sys.argv]),
                          **json.loads(child.stdout.splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
