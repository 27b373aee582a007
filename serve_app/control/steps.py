"""The engine's half of the two-level policy: under the cluster's ceiling, how many draft tokens
this decode step verifies. Batch, acceptance and step cost in; a draft length out.

The cluster controller (:func:`serve_app.control.policy.decide`) sets ``ceiling``: the most
draft steps any replica may run now. Each engine step then calls :func:`choose_steps` with
what the engine knows at that moment:

- the acceptance estimate of every sequence in the batch, by draft position (:class:`Acceptance`,
  decayed counts per request that start from the engine's own);
- the cost of a step of ``batch`` sequences, each fed ``1 +`` its own drafts, drafted in ``k``
  sequential draft passes, ``k`` the longest (:class:`StepCost`, learned online from the
  engine's own steps).

A sequence whose draft at position ``j`` is accepted with probability ``a_j`` once the ones
before it were (the first rejection ends the run) gains ``1 + a_1 + a_1·a_2 + ...`` tokens from
a verify of ``k`` drafts; a draft head's later guesses are accepted less often than its first.
The choice maximizes the batch's expected tokens per second of step time, with a draft length
for each sequence (:func:`best_lengths`; the verify feeds each only its own drafts) or, with
``per_sequence`` false, one for the whole batch; sequences whose own cap is lower (a
per-request ``max_steps``, a long prompt, the end of ``max_tokens``) draft less either way.

The gate: when the estimates make every ``k > 0`` lose, speculation stops and the estimates
stop moving. Every ``probe_interval_s`` one step drafts ``probe_steps`` tokens anyway, no
more often than :func:`probe_spacing` allows (the probes' extra cost within
``probe_budget``), so a change of traffic (copy-heavy prompts after chat) is seen and
speculation comes back. A probe drafts for ``probe_rows`` sequences of the batch, those with
the least draft-head backlog: a head that has not run since the gate shut must first catch up
on every position decoded meanwhile, prompts included, and a few sequences tell the
acceptance as well as the whole batch. Sequences the engine measures for free (``free``:
prompt lookup's drafts, scored against the tokens plain steps decode) keep their estimates
moving while the gate is shut and are never probed.

Pure: no torch, no clock, no I/O. The engine owns the state objects and the time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field

from serve_app.strict import Strict


class StepPolicyConfig(Strict):
    """How an engine picks each step's draft length under the cluster's ceiling."""

    probe_interval_s: float = Field(1.0, gt=0, description="while the gate is shut, one probing step this often")
    probe_steps: int = Field(1, ge=1, description="draft tokens of a probing step (capped by the ceiling)")
    probe_rows: int = Field(
        2, ge=1, description="sequences a probing step drafts for: those whose draft head has the fewest positions "
        "to catch up on (the rest of the batch verifies no draft)")
    probe_every_steps: int = Field(4, ge=1, description="while the gate is shut, at most one probing step in this many")
    probe_budget: float = Field(
        0.02, gt=0, le=1, description="while the gate is shut, probing steps cost at most this share of step time "
        "over plain decoding (a probe that doubles a step's cost runs at most one step in 1 / budget)")
    min_gain: float = Field(1.02, ge=1.0, description="k > 0 must beat plain decoding by this factor")
    prior_trials: float = Field(
        2.0, ge=0, description="weight, in tries per draft position, of the engine's acceptance in a request's")
    request_half_life: float = Field(8.0, gt=0, description="a request's estimate halves old evidence every N verifies")
    engine_half_life: float = Field(
        256.0, gt=0, description="the engine's estimate halves old evidence every N verifies (one per request a step)")
    initial_acceptance: float = Field(0.5, ge=0, le=1, description="the engine's estimate before any verify")
    per_sequence: bool = Field(
        True, description="each sequence of a step its own draft length, the verify fed each sequence only its "
        "own drafts; False: one length for the whole batch")


def _clip(a: float) -> float:
    return min(max(a, 0.0), 1.0)


def expected_tokens(acceptance: float | Sequence[float], k: int) -> float:
    """Tokens a sequence gains from one verify of ``k`` drafts: 1 + a_1 + a_1·a_2 + ... over the
    first ``k`` positions. ``acceptance``: one probability for every position (1 + a + ... +
    a^k), or one per position, the last standing for the positions past the list."""
    if not isinstance(acceptance, (int, float)):
        total, run = 1.0, 1.0
        for j in range(k):
            run *= _clip(acceptance[min(j, len(acceptance) - 1)]) if acceptance else 0.0
            total += run
        return total
    a = _clip(acceptance)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class Acceptance:
    """Acceptance by draft position, from decayed counts: at position j, the drafts accepted over
    the drafts tried there.

    A verify of ``k`` drafts that accepts ``n`` tried positions 1..n+1 (1..k if all were
    accepted) and accepted 1..n: the drafts after the first rejection were never tried. Old
    evidence halves every ``half_life`` verifies.
    """

    half_life: float
    accepted: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        tried = accepted + (1 if accepted < proposed else 0)
        keep = 0.5 ** (1.0 / self.half_life)
        if len(self.trials) < tried:
            self.trials += [0.0] * (tried - len(self.trials))
            self.accepted += [0.0] * (tried - len(self.accepted))
        for j in range(len(self.trials)):
            self.trials[j] = self.trials[j] * keep + (1.0 if j < tried else 0.0)
            self.accepted[j] = self.accepted[j] * keep + (1.0 if j < accepted else 0.0)

    def estimate(self, prior: float | Sequence[float], prior_trials: float, depth: int) -> list[float]:
        """Acceptance at positions 1..depth, each with the prior's (one number, or one per
        position, the last for the positions past it) counted as ``prior_trials`` trials."""
        out = []
        for j in range(depth):
            p = prior if isinstance(prior, (int, float)) else prior[min(j, len(prior) - 1)]
            tried = self.trials[j] if j < len(self.trials) else 0.0
            hit = self.accepted[j] if j < len(self.accepted) else 0.0
            total = tried + prior_trials
            out.append((hit + p * prior_trials) / total if total > 0 else p)
        return out


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a·x = b (Gaussian elimination, partial pivoting); None if a is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _add(sums: list[float], x1: float, x2: float, y: float, keep: float) -> list[float]:
    """Decayed least-squares sums for ``y = c0 + c1·x1 + c2·x2``: x_i·x_j (i <= j, x0 = 1) and x_i·y."""
    terms = (x1, x2, x1 * x1, x1 * x2, x2 * x2, y, x1 * y, x2 * y, 1.0)
    return [s * keep + t for s, t in zip(sums, terms, strict=True)]


def _fit(sums: list[float]) -> tuple[float, float, float] | None:
    """(c0, c1, c2) of the sums, all >= 0; without the x2 term where x2 never varied apart from
    x1 (or the full fit goes negative); None where x1 did not vary either."""
    s01, s02, s11, s12, s22, y0, y1, y2, n = sums
    if n <= 0:
        return None
    full = _solve([[n, s01, s02], [s01, s11, s12], [s02, s12, s22]], [y0, y1, y2])
    if full is not None and min(full) >= 0:
        return full[0], full[1], full[2]
    two = _solve([[n, s01], [s01, s11]], [y0, y1])
    if two is not None and min(two) >= 0:
        return two[0], two[1], 0.0
    return None


@dataclass(slots=True)
class StepCost:
    """Seconds per decode step of ``batch`` sequences at ``k`` drafts, in two parts: the
    verify (the target's forward over ``1 + k`` positions a sequence, and the rest of the step)
    and the draft head's ``propose``.

    The verify is a linear model, corrected cell by cell where steps of that batch and draft
    length were seen. The model is ``base + per_row · batch · (1 + k) + per_draft · k``, fitted
    to the engine's own steps by decayed least squares. A CPU step reads every weight once
    (``base``) and computes each fed row (``per_row``); a GPU step below its compute roof is
    nearly flat in rows. Until the steps seen pin down all three, the fit keeps the prior's
    shape: ``prior_rows`` rows double the cost of one, drafting costs nothing extra.

    Real steps are not linear in fed rows: on the CPU a lone sequence's first draft adds more to
    its step than each later one, and CUDA graphs are captured per batch size. So each
    (batch, k) seen keeps the decayed
    mean of its steps' verify time over the model's prediction at the time, ``cell_half_life``
    of its own steps, with ``cell_prior`` steps' weight on 1 (the model as it stands). The model,
    refitted every step, follows the host's speed; the cells keep the shape, and a cell never
    seen is the model's.

    The head's part is ``head_base + head_per_row · rows + head_per_pass · k``, fitted the same
    way to the drafting steps' ``propose`` time, where ``rows`` counts the positions the head ran
    over (the catch-up on what was decoded since it last ran, and ``k`` draft passes of the
    batch) and each of the ``k`` passes, run one after the other, has a cost of its own. A step
    that resumes drafting (a new request, a gate's probe after plain steps) catches up on many
    positions; its verify is an ordinary one and feeds its cell. Drafting that goes on catches
    up on ``1 + accepted`` positions a sequence, priced at its most, ``1 + k``.
    """

    prior_rows: float = 16.0
    half_life: float = 200.0
    cell_half_life: float = 32.0
    cell_prior: float = 2.0
    n: float = 0.0
    sums: list[float] = field(default_factory=lambda: [0.0] * 9)
    """Decayed sums of x_i·x_j (i <= j, x = (1, rows, k)) and of x_i·y."""
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    """(batch, k) -> [decayed sum of measured / model, decayed count]."""
    fit: tuple[float, float, float] | None = None
    """The coefficients of the sums as they stand (None: not solved since the last step)."""
    head_sums: list[float] = field(default_factory=lambda: [0.0] * 9)
    """Decayed sums of the head's fit, x = (1, positions, k)."""
    head_fit: tuple[float, float, float] | None = None
    """The head's coefficients as they stand (None: not solved since its last step)."""

    def observe(self, batch: int, k: int, seconds: float, head_s: float = 0.0, head_rows: int = 0,
                fed: int | None = None) -> None:
        """A decode step's time, of which ``head_s`` the draft head's ``propose`` took over
        ``head_rows`` positions (its catch-up and the ``k`` draft passes); ``fed``: the positions
        the verify fed (None: ``batch * (1 + k)``, every sequence padded to the longest draft)."""
        keep = 0.5 ** (1.0 / self.half_life)
        if k > 0 and head_s > 0 and head_rows > 0:
            self.head_sums = _add(self.head_sums, float(head_rows), float(k), head_s, keep)
            self.head_fit = None
        seconds -= head_s
        if seconds <= 0:
            return
        fed = batch * (1 + k) if fed is None else fed
        self.sums = _add(self.sums, float(fed), float(k), seconds, keep)
        self.n = self.sums[8]
        self.fit = None
        model = self.model(batch, k, fed)
        if model > 0:
            cell = self.cells.setdefault((batch, k), [0.0, 0.0])
            keep = 0.5 ** (1.0 / self.cell_half_life)
            cell[0] = cell[0] * keep + seconds / model
            cell[1] = cell[1] * keep + 1.0

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_row, per_draft) in seconds; relative units (base 1) before any step was seen."""
        if self.fit is None:
            self.fit = self._solve()
        return self.fit

    def _solve(self) -> tuple[float, float, float]:
        if self.n <= 0:
            return 1.0, 1.0 / self.prior_rows, 0.0
        fit = _fit(self.sums)
        if fit is not None:
            return fit
        # One row count seen (or a fit that goes negative): the prior's shape, scaled to the mean.
        mean_x, mean_y = self.sums[0] / self.n, self.sums[5] / self.n
        base = mean_y / (1.0 + mean_x / self.prior_rows)
        return base, base / self.prior_rows, 0.0

    def model(self, batch: int, k: int, fed: int | None = None) -> float:
        """The linear model's seconds, without the cell's correction; ``fed`` as in :meth:`observe`."""
        base, per_row, per_draft = self.coefficients()
        return base + per_row * (batch * (1 + k) if fed is None else fed) + per_draft * k

    def head_coefficients(self) -> tuple[float, float, float]:
        """(head_base, head_per_row, head_per_pass) in seconds; zeros before any drafting step."""
        if self.head_fit is None:
            positions, y = self.head_sums[0], self.head_sums[5]
            per_position = (0.0, y / positions, 0.0) if positions > 0 else (0.0, 0.0, 0.0)
            self.head_fit = _fit(self.head_sums) or per_position  # one count seen: time per position
        return self.head_fit

    def head(self, batch: int, k: int) -> float:
        """The head's seconds in a step of drafting that goes on for ``batch`` sequences: a
        catch-up of at most ``1 + k`` positions a sequence, then ``k`` draft passes one after
        the other."""
        if k <= 0 or batch <= 0:
            return 0.0
        head_base, head_per_row, head_per_pass = self.head_coefficients()
        return head_base + head_per_row * batch * (1 + 2 * k) + head_per_pass * k

    def scale(self, batch: int, k: int) -> float:
        """The cell's ratio of measured to modelled verify time (1 where none was seen)."""
        cell = self.cells.get((batch, k))
        return 1.0 if cell is None else (cell[0] + self.cell_prior) / (cell[1] + self.cell_prior)

    def verify(self, batch: int, k: int, fed: int | None = None) -> float:
        """The step without the head: the model times the cell's ratio."""
        return self.model(batch, k, fed) * self.scale(batch, k)

    def seconds(self, batch: int, k: int, head_batch: int | None = None) -> float:
        """A step of ``batch`` sequences at ``k`` drafts, the head drafting for ``head_batch``
        of them (None: all; the others are drafted without a model, by prompt lookup)."""
        return self.verify(batch, k) + self.head(batch if head_batch is None else head_batch, k)

    def seconds_for(self, lengths: Sequence[int], heads: Sequence[bool] | None = None) -> float:
        """A step whose sequences draft ``lengths``, each fed only its own (a ragged verify),
        the head running the longest length's passes for the sequences of ``heads`` that draft
        (None: every one)."""
        k = max(lengths, default=0)
        drafting = sum(1 for i, n in enumerate(lengths) if n > 0 and (heads is None or heads[i]))
        return self.verify(len(lengths), k, len(lengths) + sum(lengths)) + self.head(drafting, k)


@dataclass(slots=True)
class GateState:
    """The gate's memory: whether speculation is shut for low acceptance, the last probe, and
    the steps since it."""

    shut: bool = False
    last_probe_at: float | None = None
    steps_since_probe: int = 0


@dataclass(slots=True, frozen=True)
class StepChoice:
    num_steps: int
    reason: str
    """ceiling (the ceiling is 0 or the batch is empty), gain (the best expected rate), gate
    (every k > 0 loses: plain decoding), probe (a probing step while the gate is shut)."""
    gate: GateState
    expected_tokens_per_s: float = 0.0
    rows: tuple[int, ...] | None = None
    """The batch positions that draft (a probe's); None: every sequence."""
    lengths: tuple[int, ...] | None = None
    """Each sequence's draft length, the longest ``num_steps`` (``per_sequence``); None: every
    sequence (of ``rows``) ``num_steps``."""


def rate(acceptances: Sequence[float | Sequence[float]], k: int, cost: StepCost, head_batch: int | None = None) -> float:
    """Expected output tokens per second of a step of these sequences at ``k`` drafts, the head
    drafting for ``head_batch`` of them (None: all)."""
    seconds = cost.seconds(len(acceptances), k) if head_batch is None else cost.seconds(len(acceptances), k, head_batch)
    return sum(expected_tokens(a, k) for a in acceptances) / seconds


def best_group_lengths(groups: int, ceiling: int, per_group: bool,
                       rate_of: Callable[[tuple[int, ...]], float]) -> tuple[float, tuple[int, ...]]:
    """(rate, lengths): the draft lengths, one per group of sequences, among ``0..ceiling`` with the
    highest ``rate_of(lengths)``: one length for every group (``per_group`` False) or each group its
    own (every combination, so for a handful of groups). Ties keep the first found, fewer drafts."""
    options = itertools.product(range(ceiling + 1), repeat=groups) if per_group else \
        ((k,) * groups for k in range(ceiling + 1))
    top = (-math.inf, (0,) * groups)
    for lengths in options:
        r = rate_of(lengths)
        if r > top[0] + 1e-12:
            top = (r, lengths)
    return top


def best_lengths(acceptances: Sequence[float | Sequence[float]], ceiling: int, cost: StepCost,
                 heads: Sequence[bool] | None = None, caps: Sequence[int] | None = None,
                 ) -> tuple[float, tuple[int, ...]]:
    """(expected tokens/s, lengths): each sequence's draft length in ``0..min(ceiling, cap)``
    that together give a ragged step (:meth:`StepCost.seconds_for`) the most expected tokens
    per second; all zeros where no drafting beats plain decoding.

    Once the longest length ``K`` is fixed, and whether the head drafts (it does where any of
    ``heads`` drafts), a step's time is a constant plus a cost per sequence: its fed rows, and
    a head row where the head drafts for it. So for a rate ``r`` each sequence's best of
    ``expected_tokens - r * cost`` is its own, and Dinkelbach's iteration (``r`` the rate of
    the last round's best, from plain decoding's) finds the best rate over every ``K`` and
    head case at once, in a few rounds. Each case's best keeps one sequence at ``K`` (and, with
    the head, one of the head's sequences drafting), so its price is the step's. Ties keep
    fewer drafts."""
    batch = len(acceptances)
    zeros = (0,) * batch
    if not batch:
        return 0.0, zeros
    heads_ = np.array([True] * batch if heads is None else [bool(h) for h in heads], dtype=bool)
    caps_ = np.array([ceiling] * batch if caps is None else [max(0, min(ceiling, c)) for c in caps], dtype=np.int64)
    plain = float(batch) / cost.seconds_for(zeros, heads)
    width = int(caps_.max())
    if width == 0:
        return plain, zeros
    n = np.arange(width + 1)
    gains = _gains(acceptances, width)
    gains[n[None, :] > caps_[:, None]] = -np.inf
    # The cases: (K, whether the head drafts), where each can happen.
    cases = [(k, h) for k in range(1, width + 1) for h in (False, True) if (heads_.any() if h else not heads_.all())]
    ks = np.array([k for k, _ in cases])
    with_head = np.array([h for _, h in cases], dtype=bool)
    base, per_row, per_draft = cost.coefficients()
    head_base, head_per_row, head_per_pass = cost.head_coefficients()
    scale = np.array([cost.scale(batch, int(k)) for k in ks])
    fixed = (base + per_draft * ks + per_row * batch) * scale + with_head * (head_base + head_per_pass * ks)
    extra = with_head * head_per_row * (1 + 2 * ks)  # a head sequence that drafts
    price = (per_row * scale)[:, None, None] * n[None, None, :] + \
        extra[:, None, None] * (heads_[None, :, None] & (n[None, None, :] > 0))  # [case, seq, length]
    tops = np.where(with_head[:, None] | ~heads_[None, :], np.minimum(caps_[None, :], ks[:, None]), 0)
    allowed = n[None, None, :] <= tops[:, :, None]
    r, top, rows = plain, (plain, zeros), np.arange(batch)
    for _ in range(64):
        value = np.where(allowed, gains[None] - r * price, -np.inf)
        scores, lengths = _best_round(value, heads_, ks, with_head)
        c = int(np.argmax(scores - r * fixed))
        if not np.isfinite(scores[c]) or scores[c] - r * fixed[c] <= 1e-12 * r * fixed[c]:
            break
        chosen = lengths[c]
        r = float(gains[rows, chosen].sum() / (fixed[c] + price[c, rows, chosen].sum()))
        top = (r, tuple(int(x) for x in chosen))
    return top


def _gains(acceptances: Sequence[float | Sequence[float]], width: int) -> np.ndarray:
    """``expected_tokens(a, k)`` for each acceptance and k in ``0..width``, [len, width + 1]."""
    table = np.zeros((len(acceptances), width))
    for i, a in enumerate(acceptances if width else ()):
        if isinstance(a, (int, float)):
            table[i] = a
        elif not a:
            table[i] = 0.0
        else:
            row = np.asarray(a[:width], dtype=float)
            table[i, :len(row)] = row
            table[i, len(row):] = row[-1]
    runs = np.cumprod(np.clip(table, 0.0, 1.0), axis=1)
    return np.concatenate([np.ones((len(acceptances), 1)), 1.0 + np.cumsum(runs, axis=1)], axis=1)


def _best_round(value: np.ndarray, heads: np.ndarray, ks: np.ndarray,
                with_head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One round of :func:`best_lengths` for every case at once: ``value`` [case, seq, length]
    (-inf where not allowed). Per case, the lengths with the most total value among those where
    one sequence drafts the case's ``ks`` and, ``with_head``, one of the head's sequences
    drafts; (total value [case], lengths [case, seq]), -inf where no lengths can."""
    case = np.arange(value.shape[0])
    free = value.argmax(axis=2)  # the first maximum: fewer drafts on a tie
    best = np.take_along_axis(value, free[:, :, None], axis=2)[:, :, 0]
    at_k = value[case, :, ks] - best  # [case, seq]: what putting a sequence at K costs
    # A head sequence at K meets both conditions (without the head: any sequence at K).
    both = np.where(with_head[:, None] & ~heads[None, :], -np.inf, at_k)
    i_both = both.argmax(axis=1)
    gain_both = both[case, i_both]
    # With the head: a sequence without the head at K, and a head sequence drafting.
    alone = np.where(with_head[:, None] & ~heads[None, :], at_k, -np.inf)
    i_alone = alone.argmax(axis=1)
    drafting_value = value[:, :, 1:].max(axis=2)
    drafting = np.where(heads[None, :], drafting_value - best, -np.inf)
    i_head = drafting.argmax(axis=1)
    gain_pair = alone[case, i_alone] + drafting[case, i_head]
    pair = gain_pair > gain_both
    lengths = free.copy()
    one = ~pair & np.isfinite(gain_both)
    lengths[case[one], i_both[one]] = ks[one]
    two = pair & np.isfinite(gain_pair)
    lengths[case[two], i_alone[two]] = ks[two]
    lengths[case[two], i_head[two]] = 1 + value[case[two], i_head[two], 1:].argmax(axis=1)
    total = best.sum(axis=1) + np.maximum(gain_both, gain_pair)
    return total, lengths


def probe_spacing(batch: int, k: int, cost: StepCost, config: StepPolicyConfig) -> int:
    """Steps between two probes of ``k`` drafts at this batch: at least ``probe_every_steps``,
    and enough that the probes' extra cost over plain steps stays within ``probe_budget``."""
    extra = cost.seconds(batch, k) / cost.seconds(batch, 0) - 1.0
    return max(config.probe_every_steps, math.ceil(extra / config.probe_budget - 1e-9))


def pick_probe_rows(backlogs: Sequence[int] | None, batch: int, config: StepPolicyConfig,
                    free: Sequence[bool] | None = None, fresh: Sequence[bool] | None = None) -> tuple[int, ...] | None:
    """The batch positions a probe drafts for: the ``probe_rows`` ``fresh`` ones first (no
    verify of their own yet), then those with the least backlog (the earliest in the batch on a
    tie; the first ones without backlogs), among those not ``free`` (sequences whose acceptance
    the engine measures without drafting); None: the whole batch; (): none (every sequence is
    free)."""
    candidates = [i for i in range(batch) if free is None or not free[i]]
    if len(candidates) == batch <= config.probe_rows:
        return None
    order = sorted(candidates, key=lambda i: (fresh is None or not fresh[i],
                                              0 if backlogs is None else backlogs[i], i))
    return tuple(sorted(order[:config.probe_rows]))


def choose_steps(ceiling: int, acceptances: Sequence[float | Sequence[float]], cost: StepCost, gate: GateState,
                 now: float, config: StepPolicyConfig, backlogs: Sequence[int] | None = None,
                 heads: Sequence[bool] | None = None, caps: Sequence[int] | None = None,
                 free: Sequence[bool] | None = None, fresh: Sequence[bool] | None = None) -> StepChoice:
    """This step's draft length: the ``k`` in ``0..ceiling`` with the most expected tokens per
    second, or with ``config.per_sequence`` each sequence's own (:func:`best_lengths`, a ragged
    verify), the longest ``k``; 0 unless it beats plain decoding by ``min_gain``. While that
    keeps speculation off, a probing step of ``probe_steps`` drafts runs every
    ``probe_interval_s`` and at most once in :func:`probe_spacing` steps, for the sequences
    :func:`pick_probe_rows` picks by ``backlogs`` (each sequence's positions its draft head has
    yet to catch up on). Each acceptance is one number or one per position. ``heads``: which
    sequences the draft head drafts for (None: all; the rest by prompt lookup, which costs no
    head time); ``caps``: each sequence's own most drafts (None: the ceiling); ``free``: the
    sequences whose acceptance the engine measures without drafting them (lookup drafts scored
    against the tokens plain steps decode), which no probe drafts for; ``fresh``: the sequences
    with no verify of their own yet, whose estimate is the engine's alone: while the gate is
    shut a probe is due for them at once (within :func:`probe_spacing`) and drafts for them
    first, so a request unlike those that shut the gate is measured from its first steps (not
    those capped at 0 drafts, which never verify one, nor the free ones).

    ``cost`` is asked ``seconds(batch, k)`` (and ``seconds(batch, k, head_batch)`` where
    ``heads`` is given) for one length a step: any object with that method works (the
    simulator passes step times read off an engine curve). Per sequence it must be a
    :class:`StepCost`."""
    if ceiling <= 0 or not acceptances:
        return StepChoice(0, "ceiling", GateState(False, gate.last_probe_at, gate.steps_since_probe + 1))
    head_batch = None if heads is None else sum(1 for h in heads if h)
    plain = rate(acceptances, 0, cost, head_batch)
    lengths = None
    if config.per_sequence and len(acceptances) > 1:  # a lone sequence: one length either way
        best, chosen = best_lengths(acceptances, ceiling, cost, heads, caps)
        best_k = max(chosen)
        lengths = chosen if len(set(chosen)) > 1 else None
    else:
        best_k, best = 0, plain
        for k in range(1, ceiling + 1):
            r = rate(acceptances, k, cost, head_batch)
            if r > best:
                best_k, best = k, r
    if best_k > 0 and best >= config.min_gain * plain:
        return StepChoice(best_k, "gain", GateState(False, gate.last_probe_at, gate.steps_since_probe + 1), best,
                          lengths=lengths)
    if not gate.shut:  # the gate shuts now; the first probe is due one interval later
        return StepChoice(0, "gate", GateState(True, now, 0), plain)
    k = min(ceiling, config.probe_steps)
    if fresh is not None:  # only those a probe can draft for: not free, not capped at 0
        fresh = [f and not (free is not None and free[i]) and (caps is None or caps[i] > 0)
                 for i, f in enumerate(fresh)]
    new = fresh is not None and any(fresh)
    due = new or gate.last_probe_at is None or now - gate.last_probe_at >= config.probe_interval_s
    rows = pick_probe_rows(backlogs, len(acceptances), config, free, fresh) if due else ()
    if rows != () and gate.steps_since_probe + 1 >= probe_spacing(len(acceptances), k, cost, config):
        probed = acceptances if rows is None else [acceptances[i] for i in rows]
        gain = sum(expected_tokens(a, k) for a in probed) + len(acceptances) - len(probed)
        return StepChoice(k, "probe", GateState(True, now, 0), gain / cost.seconds(len(acceptances), k), rows)
    return StepChoice(0, "gate", GateState(True, gate.last_probe_at, gate.steps_since_probe + 1), plain)
