"""Choosing tokens: plain sampling, and verifying draft tokens against the target.

Greedy verify accepts the longest prefix of the draft that equals the target's argmax,
then adds the target's own next token: the output is exactly what plain greedy decoding
gives. With temperature > 0, ``rejection_sample`` accepts a draft token x with probability
min(1, p(x)/q(x)) and on rejection resamples from the normalised residual max(0, p - q),
which leaves the output distributed as the target's p.
"""

from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution over the last dim after temperature and nucleus filtering."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(dim=-1) - sorted_p > top_p  # keep the smallest set with mass >= top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_verify(draft: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Tokens to emit and the number of draft tokens accepted.

    ``target_argmax[i]`` is the target's choice after the context plus draft[:i];
    it has len(draft) + 1 entries.
    """
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]], n


def rejection_sample(draft: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al. / Chen et al.).

    ``target_probs`` [len(draft)+1, V]; ``draft_probs`` [len(draft), V], or None for a
    deterministic drafter (q is then one-hot on the draft token).
    Returns the tokens to emit and the number of draft tokens accepted.
    """
    out: list[int] = []
    for i, x in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else None
        qx = float(q[x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, float(p[x]) / qx):
            out.append(x)
            continue
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        out.append(sample(residual / total, generator) if total > 0 else sample(p, generator))
        return out, i
    out.append(sample(target_probs[len(draft)], generator))
    return out, len(draft)
