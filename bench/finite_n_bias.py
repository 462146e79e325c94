"""How far the answer each sampler returns is from its target, at finite compute.

On the enumerable tiny model of tests/test_mcmc_exactness.py (4-token vocabulary, prompt
[0, 1], a 3-token budget: 40 completions, so pi ∝ p^alpha · exp(beta · D) is known exactly),
the distribution of the *returned answer* of each sampler is estimated from many
independent runs of the same prompt (one batch), and its total-variation distance to pi
is reported with the forward passes it cost:

- smc: power_smc (beta 0) and degs_smc (beta 5, the library's default) at N particles.
  The returned particle is drawn by final weight, so its distribution is exactly
  E[Σ_i W̄_i δ(x_i)]; the estimate is the mean of that over runs (no sampling noise of the
  final draw). Schedule: the library's defaults (alpha 4, ESS < N/2) scaled to the 3-token
  budget: the ESS checked after every token (default: every 64 of 3,072), no ramp (400 of
  3,072 tokens is less than one token here; a ramp of 1 or 2 tokens gives the same
  numbers, because the weights telescope before any check can tell). Also at other ESS
  thresholds (0: never resample, plain importance sampling; 1: resample at every check).
- mcmc: power_mcmc and degs_mcmc chains from the prompt: one 3-token block with k MH steps,
  and the defaults' shape (one block per token, 10 MH steps each). Distribution: the
  final states' histogram.
- sps: scalable_power, blocks of 2 tokens (a block, then the last token), jackknife, the
  rollouts' horizon the default 192 (covers the rest of the budget, so zeta_hat is
  unbiased), candidate blocks drawn at temperature 1/alpha or 1, for several (L, K, M);
  (32, 8, 8) is the default. Distribution: the answers' histogram.
- reference rows: TV of the base model p and of the temperature-1/alpha proposal q to pi
  (exact, no sampling).

`tv` is the TV of the estimate; `tv_noise` the TV that the estimate's sampling noise alone
gives (bootstrap over runs for smc; for histograms, the mean TV of `runs` i.i.d. draws
from pi, simulated): a `tv` near `tv_noise` means "no distance measurable at this many
runs". `forwards` is the mean number of token positions run through the model per
returned answer (prefill included; for SMC all N particles, for SPS candidates and
rollouts). Runs on CPU: the defaults took 45 CPU-minutes on 2 cores (the SPS part most
of it); `--parts`, fewer `--sps-settings` or smaller `--chains` / `--sps-answers` for less:

    python bench/finite_n_bias.py > bench/results/DATE_cpu_finite_n_bias.jsonl

Prints one JSON record per row (and appends them to $OUT/finite_n_bias.jsonl when $OUT
is set); the first record is the environment (device, versions, date, command).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import emit, environment

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from test_mcmc_exactness import (BLOCK, EOS, LSUB, PROMPT, completion_index,  # noqa: E402
                                 enumerable_model, exact_stats, pick_tau, target)

from degs_jax.generation import GenState, pad_prompts, prefill  # noqa: E402
from degs_jax.methods import hyperparameters_for  # noqa: E402
from degs_jax.mcmc import run_chains  # noqa: E402
from degs_jax.models import TransformerLM, forward  # noqa: E402
from degs_jax.rows import repeat_rows  # noqa: E402
from degs_jax.smc import final_weights, run_smc  # noqa: E402
from degs_jax.sps import run_sps  # noqa: E402

ALPHA = 4.0
DEGS_BETA = hyperparameters_for("degs_smc").beta  # the default (degs_mcmc's too)
OUT_NAME = "finite_n_bias.jsonl"


@dataclasses.dataclass(frozen=True)
class Enumerated:
    cfg: object
    params: object
    tau: float
    logp: np.ndarray  # [40] log p(x)
    logq: np.ndarray  # [40] log q(x), q the temperature-1/alpha proposal
    depth: np.ndarray  # [40] D(x)

    def pi(self, beta: float) -> np.ndarray:
        return target(self.logp, self.depth, ALPHA, beta)


def enumerate_model() -> Enumerated:
    cfg, params = enumerable_model()
    tau = pick_tau(exact_stats(cfg, params, None)[3])
    seqs, logp, depth, _ = exact_stats(cfg, params, tau)
    logq = []
    for x in seqs:
        tokens = jnp.asarray([PROMPT + list(x)], jnp.int32)
        logits = forward(params, cfg, tokens, jnp.arange(tokens.shape[1])[None]).logits[0]
        log_q = jax.nn.log_softmax(ALPHA * jax.nn.log_softmax(logits, -1), -1)
        logq.append(sum(float(log_q[len(PROMPT) - 1 + i, t]) for i, t in enumerate(x)))
    return Enumerated(cfg, params, tau, logp, np.array(logq), depth)


def tv(mu: np.ndarray, pi: np.ndarray) -> float:
    """TV between a distribution over the support + one outside bin, and pi."""
    return float(0.5 * np.abs(mu - np.append(pi, 0.0)).sum())


def histogram(index: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(index, minlength=size + 1) / len(index)


def histogram_noise(pi: np.ndarray, draws: int, seed: int = 0) -> float:
    """Mean TV(empirical distribution of `draws` i.i.d. samples from pi, pi)."""
    sims = np.random.default_rng(seed).multinomial(draws, pi, size=2000) / draws
    return float(np.mean(0.5 * np.abs(sims - pi).sum(1)))


def prefilled(model: Enumerated, rows: int) -> GenState:
    lm = TransformerLM(model.cfg)
    tokens, lengths = pad_prompts([PROMPT], multiple=1)
    gen = prefill(lm, model.params, jnp.asarray(tokens), jnp.asarray(lengths), len(PROMPT) + BLOCK, jnp.float32)
    return repeat_rows(gen, rows)


def lens_overrides(model: Enumerated) -> dict:
    return dict(tau=model.tau, lsub=LSUB)


def smc_rows(model: Enumerated, particles: list[int], thresholds: list[float], threshold_particles: list[int],
             rows_per_call: int, seed: int):
    lm = TransformerLM(model.cfg)
    for method in ("power_smc", "degs_smc"):
        config = hyperparameters_for(method, max_new_tokens=BLOCK, ramp_tokens=0, resample_every=1,
                                     **lens_overrides(model))
        pi = model.pi(config.beta)
        settings = [(n, config.ess_threshold) for n in particles]
        settings += [(n, t) for n in threshold_particles for t in thresholds if t != config.ess_threshold]
        for n, threshold in settings:
            smc = dataclasses.replace(config, n_particles=n, ess_threshold=threshold).kernel_config(
                model.cfg.num_layers, (EOS,))
            runs = max(rows_per_call // n, 64)
            keys = jax.random.split(jax.random.key(seed + n), runs * n)
            state = run_smc(lm, model.params, prefilled(model, runs * n), keys, smc)
            weights, _, _ = jax.device_get(final_weights(state, keys, n))
            index = completion_index(*jax.device_get((state.gen.tokens, state.gen.length))).reshape(runs, n)
            per_run = np.zeros((runs, len(pi) + 1))
            np.add.at(per_run, (np.repeat(np.arange(runs), n), index.ravel()), np.asarray(weights, np.float64).ravel())
            mu = per_run.mean(0)
            boot = np.random.default_rng(0).integers(0, runs, size=(200, runs))
            noise = np.mean([0.5 * np.abs(per_run[b].mean(0) - mu).sum() for b in boot])
            forwards = np.asarray(state.gen.n_forward).reshape(runs, n).sum(1).mean()
            emit(dict(part="smc", method=method, alpha=ALPHA, beta=config.beta, n_particles=n,
                      ess_threshold=smc.ess_threshold, resample_every=smc.resample_every,
                      ramp_tokens=smc.ramp_tokens, runs=runs, tv=tv(mu, pi), tv_noise=float(noise),
                      resamples_per_run=float(np.asarray(state.resamples).mean()),
                      forwards=float(forwards)), OUT_NAME)


def mcmc_rows(model: Enumerated, steps: list[int], chains: int, seed: int):
    lm = TransformerLM(model.cfg)
    shapes = [dict(block_len=BLOCK, num_blocks=1, mh_steps=k) for k in steps]
    shapes.append(dict(block_len=1, num_blocks=BLOCK, mh_steps=hyperparameters_for("power_mcmc").mh_steps))
    for method in ("power_mcmc", "degs_mcmc"):
        for shape in shapes:
            config = hyperparameters_for(method, **shape, **lens_overrides(model))
            beta, pi = config.beta, model.pi(config.beta)
            mc = config.kernel_config(model.cfg.num_layers, (EOS,))
            keys = jax.random.split(jax.random.key(seed), chains)
            run = run_chains(lm, model.params, prefilled(model, chains), keys, mc)
            chains = run.chains()
            index = completion_index(*jax.device_get((chains.tokens, chains.length)))
            emit(dict(part="mcmc", method=method, alpha=ALPHA, beta=beta, **shape, chains=chains,
                      tv=tv(histogram(index, len(pi)), pi), tv_noise=histogram_noise(pi, chains),
                      acceptance=float(np.asarray(run.decisions.accepted).sum() / (np.asarray(run.ran).sum() * mc.mh_steps)),
                      forwards=float(np.asarray(chains.n_forward).mean())), OUT_NAME)


def sps_rows(model: Enumerated, settings: list[tuple[int, int, int]], answers: int, chunk: int, seed: int):
    lm = TransformerLM(model.cfg)
    pi = model.pi(0.0)
    for pool, kept, rollouts in settings:
        for temperature in (1.0 / ALPHA, 1.0):
            config = hyperparameters_for("scalable_power", max_new_tokens=BLOCK, block_len=2, candidate_pool=pool,
                                         candidates_kept=kept, rollouts=rollouts, candidate_temperature=temperature)
            sps = config.kernel_config(0, (EOS,))
            index, forwards = [], []
            for start in range(0, answers, chunk):
                keys = jax.random.split(jax.random.key(seed + start), chunk)
                state, _ = run_sps(lm, model.params, prefilled(model, chunk), keys, sps)
                index.append(completion_index(*jax.device_get((state.tokens, state.length))))
                forwards.append(np.asarray(state.n_forward))
            index = np.concatenate(index)
            emit(dict(part="sps", method="scalable_power", alpha=ALPHA, block_len=2, candidate_pool=pool,
                      candidates_kept=kept, rollouts=rollouts, rollout_horizon=sps.rollout_horizon,
                      candidate_temperature=temperature, runs=len(index),
                      tv=tv(histogram(index, len(pi)), pi), tv_noise=histogram_noise(pi, len(index)),
                      forwards=float(np.concatenate(forwards).mean())), OUT_NAME)


def reference_rows(model: Enumerated):
    for beta in (0.0, DEGS_BETA):
        pi = model.pi(beta)
        for name, log_dist in (("base model p", model.logp), ("proposal q (temperature 1/alpha)", model.logq)):
            dist = np.exp(log_dist - np.logaddexp.reduce(log_dist))
            emit(dict(part="reference", distribution=name, alpha=ALPHA, beta=beta, tv=tv(np.append(dist, 0.0), pi)),
                 OUT_NAME)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["reference", "smc", "mcmc", "sps"],
                    choices=["reference", "smc", "mcmc", "sps"])
    ap.add_argument("--particles", type=int, nargs="+", default=[2, 4, 16, 64, 256, 1024])
    ap.add_argument("--ess-thresholds", type=float, nargs="+", default=[0.0, 1.0],
                    help="other ESS thresholds (0: never resample, 1: at every check), at --threshold-particles")
    ap.add_argument("--threshold-particles", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--smc-rows", type=int, default=131072,
                    help="particle rows per SMC setting (runs = rows / N, at least 64)")
    ap.add_argument("--mh-steps", type=int, nargs="+", default=[1, 2, 4, 10, 32])
    ap.add_argument("--chains", type=int, default=40000)
    ap.add_argument("--sps-settings", nargs="+", default=["4,2,4", "8,4,8", "32,8,8", "64,13,8", "128,13,32"],
                    help="L,K,M per setting (candidate pool, kept, rollouts); 13 = every 2-token block")
    ap.add_argument("--sps-answers", type=int, default=20000)
    ap.add_argument("--sps-chunk", type=int, default=2000, help="SPS answers per call")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.sps_answers % args.sps_chunk:
        raise SystemExit("--sps-answers must be a multiple of --sps-chunk")
    emit(dict(part="environment", **environment()), OUT_NAME)
    model = enumerate_model()
    if "reference" in args.parts:
        reference_rows(model)
    if "smc" in args.parts:
        smc_rows(model, args.particles, args.ess_thresholds, args.threshold_particles, args.smc_rows, args.seed)
    if "mcmc" in args.parts:
        mcmc_rows(model, args.mh_steps, args.chains, args.seed)
    if "sps" in args.parts:
        settings = [tuple(int(v) for v in s.split(",")) for s in args.sps_settings]
        sps_rows(model, settings, args.sps_answers, args.sps_chunk, args.seed)


if __name__ == "__main__":
    main()
