"""The paper's reported numbers, for side-by-side tables only (the paper is named in docs/design.md).

Every value here is copied from the LaTeX source of "Depth-Entropy Guided Sampling for
Training-Free LLM Reasoning"; the comment above each constant names the table or
sentence. Accuracies are fractions (the ablation tables' percentages divided by 100).
Benchmark and method keys are this library's names (the rows' labels, the paper's
names for them, are the methods' own: ``StudyRow.label``, ``degs_jax.method``).
"""

from __future__ import annotations

BENCHMARK_LABELS = {
    "math500": "MATH500", "deepmind500": "DeepMind500", "gsm8k": "GSM8K (test)",
    "humaneval": "HumanEval pass@1", "gpqa_diamond": "GPQA-Diamond",
}

_T1_BENCHMARKS = ("math500", "deepmind500", "humaneval", "gpqa_diamond")


def _rows(rows: dict[str, tuple[float, float, float, float]]) -> dict[str, dict[str, float]]:
    return {m: dict(zip(_T1_BENCHMARKS, v)) for m, v in rows.items()}


# Table 1 (tab:main-results) and Table tab:appendix-full-results (same data). GRPO rows
# are left out: a trained model, not a decoder. No GSM8K column in the paper.
TABLE1 = {
    "Qwen2.5-7B": _rows({
        "greedy": (0.498, 0.250, 0.329, 0.278),
        "temperature": (0.628, 0.342, 0.524, 0.303),
        "best_of_n": (0.650, 0.395, 0.609, 0.282),
        "power_mcmc": (0.706, 0.537, 0.622, 0.318),
        "scalable_power": (0.708, 0.549, 0.756, 0.349),
        "power_smc": (0.714, 0.563, 0.761, 0.351),
        "best_of_n_entropy": (0.664, 0.412, 0.632, 0.348),
        "degs_mcmc": (0.728, 0.573, 0.769, 0.393),
    }),
    "Qwen2.5-Math-7B": _rows({
        "greedy": (0.496, 0.332, 0.329, 0.278),
        "temperature": (0.690, 0.482, 0.512, 0.353),
        "best_of_n": (0.684, 0.465, 0.512, 0.343),
        "power_mcmc": (0.748, 0.574, 0.573, 0.389),
        "scalable_power": (0.758, 0.593, 0.604, 0.409),
        "power_smc": (0.762, 0.601, 0.612, 0.413),
        "best_of_n_entropy": (0.687, 0.479, 0.537, 0.369),
        "degs_mcmc": (0.767, 0.619, 0.618, 0.426),
    }),
    "DeepSeek-Math-7B": _rows({
        "greedy": (0.362, 0.212, 0.415, 0.333),
        "temperature": (0.366, 0.269, 0.427, 0.430),
        "best_of_n": (0.420, 0.276, 0.433, 0.338),
        "power_mcmc": (0.424, 0.307, 0.470, 0.345),
        "scalable_power": (0.464, 0.314, 0.487, 0.364),
        "power_smc": (0.467, 0.329, 0.498, 0.386),
        "best_of_n_entropy": (0.423, 0.298, 0.453, 0.341),
        "degs_mcmc": (0.475, 0.336, 0.508, 0.392),
    }),
}

# Table tab:core-ablation (Qwen2.5-Math-7B; percentages / 100; no HumanEval column).
CORE_ABLATION = {
    "model": "Qwen2.5-Math-7B",
    "rows": {
        "best_of_n": {"math500": 0.684, "deepmind500": 0.465, "gpqa_diamond": 0.343},
        "power_mcmc": {"math500": 0.748, "deepmind500": 0.574, "gpqa_diamond": 0.389},
        "depth_only": {"math500": 0.632, "deepmind500": 0.414, "gpqa_diamond": 0.328},
        "best_of_n_entropy": {"math500": 0.687, "deepmind500": 0.479, "gpqa_diamond": 0.369},
        "degs_rerank": {"math500": 0.716, "deepmind500": 0.548, "gpqa_diamond": 0.362},
        "degs_mcmc": {"math500": 0.767, "deepmind500": 0.619, "gpqa_diamond": 0.426},
    },
}

# Table tab:lsub-tradeoff: L_sub for the 28-layer Qwen models, K, relative wall-clock
# overhead, MATH500 / GPQA accuracy (Qwen2.5-Math-7B) and DeepMind500 (DeepSeek-Math-7B,
# whose grid is the 30-layer one; the paper lists the 28-layer sets for every row).
LSUB_TABLE = [
    {"lsub": "all", "K": 28, "overhead": 1.05, "math500": 0.771, "gpqa_diamond": 0.426, "deepmind500": 0.339},
    {"lsub": [4, 8, 12, 16, 20, 24, 28], "K": 7, "overhead": 1.00, "math500": 0.767, "gpqa_diamond": 0.426, "deepmind500": 0.336},
    {"lsub": [8, 12, 16, 20, 24, 28], "K": 6, "overhead": 0.98, "math500": 0.767, "gpqa_diamond": 0.426, "deepmind500": 0.336},
    {"lsub": [12, 16, 20, 24, 28], "K": 5, "overhead": 0.98, "math500": 0.767, "gpqa_diamond": 0.426, "deepmind500": 0.336},
    {"lsub": [16, 20, 24, 28], "K": 4, "overhead": 0.99, "math500": 0.766, "gpqa_diamond": 0.426, "deepmind500": 0.334},
    {"lsub": [12, 16, 20, 24], "K": 4, "overhead": 0.98, "math500": 0.765, "gpqa_diamond": 0.424, "deepmind500": 0.334},
    {"lsub": [8, 12, 16, 20], "K": 4, "overhead": 0.99, "math500": 0.762, "gpqa_diamond": 0.421, "deepmind500": 0.321},
    {"lsub": [4, 8, 12, 16], "K": 4, "overhead": 0.99, "math500": 0.759, "gpqa_diamond": 0.418, "deepmind500": 0.320},
    {"lsub": [1, 4, 8, 12], "K": 4, "overhead": 0.98, "math500": 0.746, "gpqa_diamond": 0.403, "deepmind500": 0.306},
    {"lsub": [1, 2, 3, 4], "K": 4, "overhead": 0.98, "math500": 0.728, "gpqa_diamond": 0.385, "deepmind500": 0.275},
]

# Table tab:compute-accounting: per-problem mean wall-clock, Qwen2.5-Math-7B / MATH500,
# one RTX 3090 ("--" rows omitted).
WALL_CLOCK_S = {
    "model": "Qwen2.5-Math-7B", "benchmark": "math500", "device": "RTX 3090",
    "seconds": {"best_of_n": 228.1, "best_of_n_entropy": 230.5, "power_mcmc": 330.5,
                "degs_rerank": 235.6, "degs_mcmc": 359.5},
}

# Section "Accuracy versus Compute Budget": probe overhead over the likelihood-only
# counterpart, per-problem wall-clock, Qwen2.5-Math-7B / MATH500.
PROBE_OVERHEAD = {"degs_mcmc_vs_power_mcmc": 0.088, "degs_rerank_vs_best_of_n": 0.033}

# Table tab:mcmc-protocol: "Measured acceptance at the canonical setting (alpha=4, beta=5):
# deepseek_math/deepmind: 78%; qwen_math/math: 57%."
ACCEPTANCE = {"DeepSeek-Math-7B / DeepMind500": 0.78, "Qwen2.5-Math-7B / MATH500": 0.57}

# Section "Does Collapse Depth Alone Predict Correctness?" (Qwen2.5-Math-7B / MATH500,
# N = 16 candidates at T = 0.8, top-p 0.9, n = 8000 candidates).
PREDICTIVE_VALIDITY = {
    "model": "Qwen2.5-Math-7B", "benchmark": "math500", "candidates": 8000,
    "auc": "≈ 0.6", "spearman_rho": "≈ 0.15", "pairwise": "barely above one-half",
    "gap": "correct > incorrect, p < 0.001",
    "buckets": "accuracy 0.17 in the lowest D(x) bucket to 0.41 in the highest "
               "(DeepMind500: top bucket ≈ 2.6× the bottom)",
}

# Section "Takeaway and statistical reliability": beta = 5 beats beta = 0 in all twelve
# (model, benchmark) cells; one-sided sign test p = 2^-12.
BETA_DIRECTION = {"cells": 12, "positive": 12, "sign_test_p": 2.0 ** -12,
                  "median_delta": "≈ 4 points"}

# The study's settings that this library's decoder defaults do not carry, for the report's
# deviations table (the decoders' own defaults are the paper's: docs/design.md §4).
# Table 1's models: 7B base and math models, prompted without a chat turn.
MODELS = ("Qwen2.5-7B", "Qwen2.5-Math-7B", "DeepSeek-Math-7B")
# The predictive-validity pool: N = 16 at T = 0.8, top-p 0.9 ("Predictive-validity
# sampling": "deliberately uses a higher-entropy regime than the decoding runs").
CANDIDATE_SAMPLING = {"n": 16, "temperature": 0.8, "top_p": 0.9}
# Table 1's Best-of-N (and Best-of-N-Entropy): "The reranking methods ... draw N = 16
# candidates"; "We disable nucleus and top-k truncation throughout (top-p = 1.0)". No
# temperature is stated for them; the DEGS-reranking appendix samples candidates "using
# moderate randomness (temperature in [0.7, 1.0], top-p = 0.95)". A pool deviates when its
# N, its temperature or its top-p is outside these.
BEST_OF_N_SAMPLING = ("N = 16, top-p 1 (nucleus off throughout); temperature not stated "
                      "(DEGS reranking appendix: T in [0.7, 1.0], top-p 0.95)")
BEST_OF_N_N = 16
BEST_OF_N_TEMPERATURES = (0.7, 1.0)
BEST_OF_N_TOP_P = (0.95, 1.0)
# Scalable Power Sampling's budget column in the full results table: "(T = 0.25)".
SPS_CANDIDATE_TEMPERATURE = 0.25
# DeepMind500: "identical prompt, parser, and grader as MATH500"; MATH500: "answer parsed
# from last \boxed{} span; graded by sympy-based symbolic/numeric matcher".
DEEPMIND_GRADER = "the MATH500 grader: a sympy-based symbolic/numeric matcher on the last boxed span"
# HumanEval: "Direct completion from function signature (no CoT); code extracted via regex";
# where a completion stops (stop sequences, token cap) is not stated.
HUMANEVAL_END = "direct completion, code extracted via regex; stop sequences not stated"
# HumanEval: the model continues the prompt (signature and docstring), the benchmark's
# convention for base models.
HUMANEVAL_PROMPT = "completion of the signature and docstring"
# Problems per Table 1 benchmark (the whole test sets).
BENCHMARK_SIZES = {"math500": 500, "deepmind500": 500, "humaneval": 164, "gpqa_diamond": 198}
# The L_sub table's accuracy column: DEGS-MCMC run with each probe set.
LSUB_MEASURE = "DEGS-MCMC accuracy with each probe set"
