"""Host memory of the stop-string automaton (`degs_jax.stops.stop_automaton`) at a real
vocabulary, for 1, 100 and 10,000 stop characters (issue 58: the dense [states x V] table
took 0.93 MiB per stop byte at Qwen's 151,936 tokens, past 4 GiB for a 10,000-character
--stop).

Each case runs in a fresh process: the peak resident set size (ru_maxrss) after the token
bytes are read and after the automaton is built, numpy's peak allocation during the build
(tracemalloc, which numpy reports to), the automaton's arrays (`StopAutomaton.nbytes`),
the build time, and the median time of the jitted device lookup of 64 rows
(`StopAutomaton.next_state`) beside the gather of the dense table where that fits. Cases: one string of N random printable characters (seeded), N times
'a' (every state continues on 'a': the most exceptions per state), and N/3 options of 3
random characters (the "3,000 --stop options" of the issue).

    python bench/stop_memory.py --tokenizer DIR [--out bench/results/FILE.jsonl]

DIR: a Hugging Face tokenizer directory (default: the Qwen2.5-Coder tokenizer, from the hub).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import string
import subprocess
import sys
import time

CASE = r'''
import json, random, resource, string, sys, time, tracemalloc
from transformers import AutoTokenizer
from degs_jax.stops import stop_automaton, token_bytes
tokenizer_dir, kind, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
pieces = token_bytes(tokenizer)
vocab = max(len(pieces), 151936)
rng = random.Random(0)
letters = string.ascii_letters + string.digits + string.punctuation + " \n"
if kind == "one_random_string":
    stops = ("".join(rng.choice(letters) for _ in range(n)),)
elif kind == "repeated_a":
    stops = ("a" * n,)
else:
    stops = tuple(sorted({"".join(rng.choice(letters) for _ in range(3)) for _ in range(n // 3)}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t0 = time.perf_counter()
automaton = stop_automaton(stops, pieces, vocab)
seconds = time.perf_counter() - t0
peak = tracemalloc.get_traced_memory()[1]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
# The device lookup of 64 rows (jitted, CPU), against a dense table's gather where one fits.
import jax, jax.numpy as jnp, numpy as np
rows = np.random.default_rng(0)
before_states = jnp.asarray(rows.integers(0, automaton.num_states, 64), jnp.int32)
toks = jnp.asarray(rows.integers(0, vocab, 64), jnp.int32)
def timed(fn):
    fn(before_states, toks).block_until_ready()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        fn(before_states, toks).block_until_ready()
        times.append(time.perf_counter() - t)
    return round(sorted(times)[100] * 1e6, 1)
lookup_us = timed(jax.jit(automaton.next_state))
dense_us = None
if automaton.num_states * vocab <= 64 * 2**20:
    table = np.array([[automaton.step(s, t) for t in range(vocab)] for s in range(automaton.num_states)]
                     ) if automaton.num_states * vocab <= 2**20 else None
    if table is None:
        table = np.broadcast_to(automaton.default, (automaton.num_states, vocab)).copy()
        table[:, automaton.empty] = np.arange(automaton.num_states)[:, None]
        for state in range(automaton.num_states):
            lo, hi = automaton.offsets[state], automaton.offsets[state + 1]
            table[state, automaton.tokens[lo:hi]] = automaton.values[lo:hi]
    dense = jnp.asarray(table.astype(np.int16 if automaton.num_states < 32767 else np.int32))
    dense_us = timed(jax.jit(lambda b, t: dense[b, t].astype(jnp.int32)))
print(json.dumps({"lookup_64_rows_us": lookup_us, "dense_gather_64_rows_us": dense_us,"case": kind, "stop_strings": len(stops), "stop_characters": sum(map(len, stops)),
                  "vocab": vocab, "states": automaton.num_states,
                  "exceptions": int(automaton.offsets[-1]),
                  "automaton_mib": round(automaton.nbytes / 2**20, 3),
                  "build_peak_alloc_mib": round(peak / 2**20, 1),
                  "max_rss_before_mib": round(before / 1024, 1), "max_rss_after_mib": round(after / 1024, 1),
                  "build_s": round(seconds, 2)}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--out", default=None, help="append the JSON lines here too")
    args = parser.parse_args()
    rows = []
    for kind in ("one_random_string", "repeated_a", "three_character_options"):
        for n in (1, 100, 10_000):
            if kind == "three_character_options" and n < 3:
                continue
            done = subprocess.run([sys.executable, "-c", CASE, args.tokenizer, kind, str(n)],
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-2000:])
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
