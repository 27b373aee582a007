"""The engine's half of the two-level policy: under the cluster's ceiling, how many draft tokens
this decode step verifies. Batch, acceptance and step cost in; a draft length out.

The cluster controller (:func:`serve_app.control.policy.decide`) sets ``ceiling``: the most
draft steps any replica may run now. Each engine step then calls :func:`choose_steps` with
what the engine knows at that moment:

- the acceptance estimate of every sequence in the batch, by draft position (:class:`Acceptance`,
  decayed counts per request that start from the engine's own);
- the cost of a step of ``batch`` sequences fed ``1 + k`` tokens each, drafted in ``k``
  sequential draft passes (:class:`StepCost`, learned online from the engine's own steps).

A sequence whose draft at position ``j`` is accepted with probability ``a_j`` once the ones
before it were (the first rejection ends the run) gains ``1 + a_1 + a_1·a_2 + ...`` tokens from
a verify of ``k`` drafts; a draft head's later guesses are accepted less often than its first.
The choice maximizes the batch's expected tokens per second of step time. The batch is
padded to its widest row, so one
draft length serves the whole batch; sequences whose own cap is lower (a per-request
``max_steps``, a long prompt, the end of ``max_tokens``) draft less inside it.

The gate: when the estimates make every ``k > 0`` lose, speculation stops and the estimates
stop moving. Every ``probe_interval_s`` one step drafts ``probe_steps`` tokens anyway, no
more often than :func:`probe_spacing` allows (the probes' extra cost within
``probe_budget``), so a change of traffic (copy-heavy prompts after chat) is seen and
speculation comes back. A probe drafts for ``probe_rows`` sequences of the batch, those with
the least draft-head backlog: a head that has not run since the gate shut must first catch up
on every position decoded meanwhile, prompts included, and a few sequences tell the
acceptance as well as the whole batch.

Pure: no torch, no clock, no I/O. The engine owns the state objects and the time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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

    def observe(self, batch: int, k: int, seconds: float, head_s: float = 0.0, head_rows: int = 0) -> None:
        """A decode step's time, of which ``head_s`` the draft head's ``propose`` took over
        ``head_rows`` positions (its catch-up and the ``k`` draft passes)."""
        keep = 0.5 ** (1.0 / self.half_life)
        if k > 0 and head_s > 0 and head_rows > 0:
            self.head_sums = _add(self.head_sums, float(head_rows), float(k), head_s, keep)
            self.head_fit = None
        seconds -= head_s
        if seconds <= 0:
            return
        self.sums = _add(self.sums, float(batch * (1 + k)), float(k), seconds, keep)
        self.n = self.sums[8]
        self.fit = None
        model = self.model(batch, k)
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

    def model(self, batch: int, k: int) -> float:
        """The linear model's seconds, without the cell's correction."""
        base, per_row, per_draft = self.coefficients()
        return base + per_row * batch * (1 + k) + per_draft * k

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

    def verify(self, batch: int, k: int) -> float:
        """The step without the head: the model times the cell's ratio."""
        cell = self.cells.get((batch, k))
        scale = 1.0 if cell is None else (cell[0] + self.cell_prior) / (cell[1] + self.cell_prior)
        return self.model(batch, k) * scale

    def seconds(self, batch: int, k: int, head_batch: int | None = None) -> float:
        """A step of ``batch`` sequences at ``k`` drafts, the head drafting for ``head_batch``
        of them (None: all; the others are drafted without a model, by prompt lookup)."""
        return self.verify(batch, k) + self.head(batch if head_batch is None else head_batch, k)


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


def probe_spacing(batch: int, k: int, cost: StepCost, config: StepPolicyConfig) -> int:
    """Steps between two probes of ``k`` drafts at this batch: at least ``probe_every_steps``,
    and enough that the probes' extra cost over plain steps stays within ``probe_budget``."""
    extra = cost.seconds(batch, k) / cost.seconds(batch, 0) - 1.0
    return max(config.probe_every_steps, math.ceil(extra / config.probe_budget - 1e-9))


def pick_probe_rows(backlogs: Sequence[int] | None, batch: int, config: StepPolicyConfig) -> tuple[int, ...] | None:
    """The batch positions a probe drafts for: the ``probe_rows`` with the least backlog (the
    earliest in the batch on a tie; the first ones without backlogs); None: the whole batch."""
    if batch <= config.probe_rows:
        return None
    order = sorted(range(batch), key=lambda i: (0 if backlogs is None else backlogs[i], i))
    return tuple(sorted(order[:config.probe_rows]))


def choose_steps(ceiling: int, acceptances: Sequence[float | Sequence[float]], cost: StepCost, gate: GateState,
                 now: float, config: StepPolicyConfig, backlogs: Sequence[int] | None = None,
                 head_batch: int | None = None) -> StepChoice:
    """This step's draft length: the ``k`` in ``0..ceiling`` with the most expected tokens per
    second; 0 unless it beats plain decoding by ``min_gain``. While that keeps speculation
    off, a probing step of ``probe_steps`` drafts runs every ``probe_interval_s`` and at most
    once in :func:`probe_spacing` steps, for the sequences :func:`pick_probe_rows` picks by
    ``backlogs`` (each sequence's positions its draft head has yet to catch up on). Each
    acceptance is one number or one per position. ``head_batch``: how many of the sequences the
    draft head drafts for (None: all; the rest by prompt lookup, which costs no head time).

    ``cost`` is asked only ``seconds(batch, k)`` (and ``seconds(batch, k, head_batch)`` where
    ``head_batch`` is given): any object with that method works (the simulator passes step times
    read off an engine curve)."""
    if ceiling <= 0 or not acceptances:
        return StepChoice(0, "ceiling", GateState(False, gate.last_probe_at, gate.steps_since_probe + 1))
    plain = rate(acceptances, 0, cost, head_batch)
    best_k, best = 0, plain
    for k in range(1, ceiling + 1):
        r = rate(acceptances, k, cost, head_batch)
        if r > best:
            best_k, best = k, r
    if best_k > 0 and best >= config.min_gain * plain:
        return StepChoice(best_k, "gain", GateState(False, gate.last_probe_at, gate.steps_since_probe + 1), best)
    if not gate.shut:  # the gate shuts now; the first probe is due one interval later
        return StepChoice(0, "gate", GateState(True, now, 0), plain)
    k = min(ceiling, config.probe_steps)
    due = gate.last_probe_at is None or now - gate.last_probe_at >= config.probe_interval_s
    if due and gate.steps_since_probe + 1 >= probe_spacing(len(acceptances), k, cost, config):
        rows = pick_probe_rows(backlogs, len(acceptances), config)
        probed = acceptances if rows is None else [acceptances[i] for i in rows]
        gain = sum(expected_tokens(a, k) for a in probed) + len(acceptances) - len(probed)
        return StepChoice(k, "probe", GateState(True, now, 0), gain / cost.seconds(len(acceptances), k), rows)
    return StepChoice(0, "gate", GateState(True, gate.last_probe_at, gate.steps_since_probe + 1), plain)
