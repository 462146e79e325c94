"""Host memory of the stop-string automaton (`degs_jax.stops.stop_automaton`) at a real
vocabulary, for 1, 100 and 10,000 stop characters (issue 58: the dense [states x V] table
took 0.93 MiB per stop byte at Qwen's 151,936 tokens, past 4 GiB for a 10,000-character
--stop).

Each case runs in a fresh process: the peak resident set size (ru_maxrss) after the token
bytes are read and after the automaton is built, numpy's peak allocation during the build
(tracemalloc, which numpy reports to), the automaton's arrays (`StopAutomaton.nbytes`)
and the build time. Cases: one string of N random printable characters (seeded), N times
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
print(json.dumps({"case": kind, "stop_strings": len(stops), "stop_characters": sum(map(len, stops)),
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
