"""The verify rules: greedy keeps the target's argmax; rejection sampling keeps its distribution."""

import torch
from scipy.stats import chisquare

from serve_app.engines.embedded.sampler import greedy_verify, probs_from_logits, rejection_sample


def test_greedy_verify_accepts_the_matching_prefix_and_adds_the_targets_token():
    assert greedy_verify([5, 6, 7], [5, 6, 9, 1]) == ([5, 6, 9], 2)
    assert greedy_verify([5, 6, 7], [5, 6, 7, 1]) == ([5, 6, 7, 1], 3)
    assert greedy_verify([5], [4, 0]) == ([4], 0)
    assert greedy_verify([], [3]) == ([3], 0)


def _first_token_counts(p, q, trials, draft_from_q=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = p.shape[-1]
    counts = torch.zeros(V)
    target = torch.stack([p, torch.full((V,), 1.0 / V)])
    for _ in range(trials):
        if draft_from_q:
            x = int(torch.multinomial(q, 1, generator=g))
            out, _ = rejection_sample([x], q[None], target, g)
        else:
            out, _ = rejection_sample([2], None, target, g)  # a deterministic drafter
        counts[out[0]] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution_with_a_sampled_draft():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=g) * 1.5, -1)
    trials = 20000
    counts = _first_token_counts(p, q, trials)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3
    # and the draft's own distribution is clearly different, so the test can tell them apart
    assert chisquare(counts.numpy(), (q * trials).numpy()).pvalue < 1e-6


def test_rejection_sampling_keeps_the_target_distribution_with_a_deterministic_draft():
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.05, 0.2])
    trials = 20000
    counts = _first_token_counts(p, None, trials, draft_from_q=False)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = probs_from_logits(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, 0.7)
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
