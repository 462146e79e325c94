"""bench/self_draft_acceptance.py predicts, from a chain's stored log q, the forwards an MH
step would take with the chain's suffix as a speculative draft (issue 55). Here the
prediction faces a simulation of the procedure itself: each draft token accepted with
probability q(d), a bonus token after k accepted ones equal to the next draft token with
probability q(d), plain decoding after the first divergence."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "self_draft_acceptance.py"
_spec = importlib.util.spec_from_file_location("self_draft_acceptance", _PATH)
self_draft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(self_draft)


def _simulate(q: np.ndarray, cut: int, k: int, rng) -> tuple[int, bool]:
    """(forwards, null move) of one proposal from `cut` with k draft tokens per forward."""
    n, pos, forwards = len(q), cut, 0
    while pos < n:
        forwards += 1
        for offset in range(k + 1):  # k draft tokens, then the bonus position
            at = pos + offset
            if at == n:
                return forwards, True
            if rng.random() >= q[at]:  # the token drawn here is not the draft's
                return forwards + (n - at - 1), False
        pos += k + 1
    return forwards, True


@pytest.mark.parametrize("k", [1, 3])
def test_the_predicted_forwards_match_a_simulation_of_speculative_verification(k):
    rng = np.random.default_rng(k)
    q = np.array([0.99, 0.97, 0.6, 0.999, 0.9, 0.95, 0.3, 0.98, 0.995, 0.85, 0.99])
    predicted = self_draft.expected_forwards(np.log(q), [k])
    trials = 4000
    runs = [_simulate(q, cut, k, rng) for cut in range(len(q)) for _ in range(trials)]
    forwards = np.array([f for f, _ in runs], float)
    null = np.array([z for _, z in runs], float)
    # tolerance: 4 standard errors of the simulated means (a 6e-5 two-sided miss rate)
    assert forwards.mean() == pytest.approx(predicted[f"forwards_k{k}"], abs=4 * forwards.std() / np.sqrt(forwards.size))
    assert null.mean() == pytest.approx(predicted["null_move"], abs=4 * null.std() / np.sqrt(null.size))
    assert predicted["regenerated"] == pytest.approx(np.mean(len(q) - np.arange(len(q))))


def test_a_certain_draft_takes_one_forward_per_k_plus_one_tokens_and_an_impossible_one_saves_nothing():
    n = 10
    sure = self_draft.expected_forwards(np.zeros(n), [1, 4, None])
    suffix = n - np.arange(n)
    assert sure["null_move"] == 1.0 and sure["aligned"] == pytest.approx(suffix.mean())
    assert sure["forwards_k1"] == pytest.approx(np.ceil(suffix / 2).mean())
    assert sure["forwards_k4"] == pytest.approx(np.ceil(suffix / 5).mean())
    assert sure["forwards_kall"] == 1.0
    never = self_draft.expected_forwards(np.full(n, -50.0), [4, None])
    assert never["forwards_k4"] == pytest.approx(suffix.mean()) and never["forwards_kall"] == pytest.approx(suffix.mean())
    assert never["null_move"] == pytest.approx(0.0, abs=1e-20)
