"""Repetition-aware sampling with injected draws: the pick rule, the nucleus, the repetition fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice_triton.config import SamplingConfig
from cosyvoice_triton.errors import LLMError
from cosyvoice_triton.models.sampling import (
    check_sampling,
    make_draw,
    nucleus_sampling,
    nucleus_size,
    pick,
    random_sampling,
    ras_sampling,
    sample_token,
    top_sorted,
)


class Counted:
    """A draw source that hands out fixed values and counts how many were taken."""

    def __init__(self, *values: float):
        self.values = list(values)
        self.taken = 0

    def __call__(self) -> float:
        u = self.values[self.taken]
        self.taken += 1
        return u


def test_pick_is_the_inverse_cdf():
    w = torch.tensor([0.25, 0.25, 0.5])  # exact in binary
    assert pick(w, 0.0) == 0
    assert pick(w, 0.2499) == 0
    assert pick(w, 0.25) == 1  # the first cumulative sum strictly above u * total
    assert pick(w, 0.4999) == 1
    assert pick(w, 0.5) == 2
    assert pick(w, 0.9999999) == 2
    assert pick(torch.tensor([2.0, 6.0]), 0.3) == 1  # unnormalised: 0.3 * 8 = 2.4 > 2
    assert pick(torch.tensor([2.0, 6.0]), 0.2) == 0


def test_pick_never_returns_zero_weight():
    w = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    picks = {pick(w, u) for u in np.linspace(0, 1, 1001, endpoint=False)}
    assert picks == {1, 3}
    assert pick(torch.tensor([0.0, 1.0, 0.0]), 0.0) == 1


def test_pick_frequencies_follow_the_weights():
    w = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    counts = np.bincount([pick(w, float(u)) for u in torch.rand(20000, generator=g, dtype=torch.float64)],
                         minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), w.numpy(), atol=0.015)
    assert counts[1] == 0


@pytest.mark.parametrize("u", [1.0, -0.1, float("nan")])
def test_pick_rejects_draws_outside_the_unit_interval(u):
    with pytest.raises(ValueError, match="u must be in"):
        pick(torch.tensor([1.0]), u)


@pytest.mark.parametrize("w", [[0.0, 0.0], [], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_pick_rejects_weights_without_a_finite_positive_total(w):
    with pytest.raises(ValueError, match="cannot draw"):
        pick(torch.tensor(w), 0.5)


def _loop_nucleus_size(sorted_probs: torch.Tensor, top_p: float, top_k: int) -> int:
    """Reference: the running mass as a 0-d float32 tensor, compared with the Python float top_p."""
    mass, kept = 0.0, 0
    for value in sorted_probs:
        if mass < top_p and kept < top_k:
            mass = mass + value
            kept += 1
        else:
            break
    return kept


def test_nucleus_size_matches_a_float32_running_sum():
    g = torch.Generator().manual_seed(1)
    for trial in range(300):
        scale = [0.5, 2.0, 6.0][trial % 3]
        probs = (scale * torch.randn(300, generator=g)).softmax(0).sort(descending=True).values
        top_p = [0.8, 0.7, 0.5, 0.95, 0.3][trial % 5]
        for top_k in (1, 5, 25):
            assert nucleus_size(probs, top_p=top_p, top_k=top_k) == _loop_nucleus_size(probs, top_p, top_k)


def test_nucleus_mass_is_compared_in_float32():
    # mass before the 2nd token is float32(0.7) = 0.69999998...: below 0.7 in float64, equal in float32.
    probs = torch.tensor([np.float32(0.7), 0.2, 0.1], dtype=torch.float32)
    assert nucleus_size(probs, top_p=0.7, top_k=25) == 1
    assert nucleus_size(probs, top_p=0.71, top_k=25) == 2
    assert nucleus_size(probs, top_p=0.8, top_k=1) == 1  # top_k bounds it
    assert nucleus_size(torch.full((100,), 0.01), top_p=0.8, top_k=25) == 25


def test_top_sorted_equals_the_full_stable_sort_with_ties():
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        probs = torch.randint(0, 6, (400,), generator=g).float() / 7  # many ties
        full_v, full_i = probs.sort(descending=True, stable=True)
        for k in (1, 7, 25, 400, 500):
            v, i = top_sorted(probs, k)
            assert torch.equal(v, full_v[:k]) and torch.equal(i, full_i[:k])


def test_nucleus_sampling_draws_within_the_nucleus():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, -2.0, 2.5])
    probs = logits.softmax(0)
    assert nucleus_sampling(logits, Counted(0.0), top_p=0.8, top_k=25) == 1  # the tie at 3.0: lower id first
    assert nucleus_sampling(logits, Counted(0.999), top_p=0.8, top_k=25) == 5
    drawn = {nucleus_sampling(logits, Counted(float(u)), top_p=0.8, top_k=25) for u in np.linspace(0, 1, 500, False)}
    assert drawn == {1, 3, 5}  # mass before id 5 is p1 + p3 < 0.8; after it > 0.8
    assert float(probs[1] + probs[3]) < 0.8 < float(probs[1] + probs[3] + probs[5])
    assert {nucleus_sampling(logits, Counted(float(u)), top_p=0.8, top_k=2) for u in np.linspace(0, 1, 50, False)} \
        == {1, 3}


def test_random_sampling_covers_the_whole_distribution():
    logits = torch.tensor([0.0, 3.0, -float("inf"), 1.0])
    drawn = {random_sampling(logits, Counted(float(u))) for u in np.linspace(0, 1, 2000, False)}
    assert drawn == {0, 1, 3}


def test_repetition_falls_back_to_the_full_distribution():
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0])  # the nucleus is token 0 alone
    draws = Counted(0.0, 0.0)
    assert ras_sampling(logits, [3, 2], draws, top_p=0.8, top_k=25, win_size=10, tau_r=0.1) == 0
    assert draws.taken == 1
    # token 0 seen in the window: re-drawn from the full distribution without it (two draws in all)
    draws = Counted(0.0, 0.0)
    assert ras_sampling(logits, [0, 2], draws, top_p=0.8, top_k=25, win_size=10, tau_r=0.1) == 1
    assert draws.taken == 2
    assert ras_sampling(logits, [0, 2], Counted(0.0, 0.99), win_size=10, tau_r=0.1) == 3
    assert logits[0] == 5.0  # the caller's scores are not modified
    # outside the last win_size tokens it does not count
    assert ras_sampling(logits, [0] + [1] * 10, Counted(0.0, 0.0), win_size=10, tau_r=0.1) == 0
    # tau_r = 0.2 over 10: two repeats needed
    assert ras_sampling(logits, [0, 1], Counted(0.0, 0.0), win_size=10, tau_r=0.2) == 0
    assert ras_sampling(logits, [0, 0], Counted(0.0, 0.0), win_size=10, tau_r=0.2) == 1


def test_sample_token_masks_only_end_of_speech():
    eos = 4
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0, 20.0, 0.0, 0.0]).log_softmax(0)
    assert sample_token(logp, [], Counted(0.0), SamplingConfig(), eos_token=eos, ignore_eos=False) == eos
    everything = SamplingConfig(top_p=1.0)
    drawn = {sample_token(logp, [], Counted(float(u)), everything, eos_token=eos, ignore_eos=True)
             for u in np.linspace(0, 1, 300, False)}
    assert eos not in drawn and drawn == {0, 1, 2, 3, 5, 6}  # eos + 1 and eos + 2 stay drawable
    assert torch.isfinite(logp).all()


def test_draw_sources():
    a, b = make_draw(7), make_draw(7)
    seq = [a() for _ in range(5)]
    assert seq == [b() for _ in range(5)] and len(set(seq)) == 5 and all(0 <= u < 1 for u in seq)
    assert seq == [float(u) for u in torch.rand(5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)]
    g = torch.Generator().manual_seed(7)
    assert make_draw(g)() == seq[0]
    listed = make_draw([0.25, 0.5])
    assert (listed(), listed()) == (0.25, 0.5)
    with pytest.raises(LLMError, match="ran out"):
        listed()
    with pytest.raises(LLMError, match=r"not in \[0, 1\)"):
        make_draw([1.5])()
    assert make_draw(lambda: 0.125)() == 0.125
    with pytest.raises(TypeError, match="draws must be"):
        make_draw(1.5)


@pytest.mark.parametrize(
    ("config", "words"),
    [(SamplingConfig(top_p=0.0), "top_p"), (SamplingConfig(top_p=1.5), "top_p"), (SamplingConfig(top_k=0), "top_k"),
     (SamplingConfig(win_size=-1), "win_size")],
)
def test_bad_sampling_config(config, words):
    with pytest.raises(LLMError, match=words):
        check_sampling(config)
