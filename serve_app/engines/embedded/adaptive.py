"""The engine's per-step draft length under the cluster's ceiling (``step_policy: adaptive``).

The decision is :func:`serve_app.control.steps.choose_steps`, a pure function; this module
holds what it reads: each running request's acceptance estimate, the engine's, the learned
step cost and the gate, and feeds them back after every decode step.
"""

from __future__ import annotations

import time
from collections import deque

from serve_app.control.steps import Acceptance, GateState, StepChoice, StepCost, StepPolicyConfig, choose_steps

HEAD = "head"  # the source of a drafter's model's drafts (drafters.Drafter.sources)
LOOKUP = "lookup"  # prompt lookup's: free to make, so scored against plain steps' tokens (shadows)
WINDOW_S = 5.0  # mean_num_steps averages the decode steps of this many seconds, as load()'s other rates


def score_shadow(draft: list[int], matched: int, tokens: list[int]) -> tuple[int, bool]:
    """A shadow draft ``draft`` whose first ``matched`` tokens equal what the sequence decoded
    since it was made, after the sequence decodes ``tokens`` more: (matched, resolved), resolved
    once a token differs or every draft token matched. A verify of the draft would have accepted
    exactly the matched tokens: under greedy decoding the target's choice is the same token, and
    under sampling a one-token draft (prompt lookup's) is accepted with the probability the
    target gives it, the probability that sampling draws it."""
    for t in tokens:
        if draft[matched] != t:
            return matched, True
        matched += 1
        if matched == len(draft):
            return matched, True
    return matched, False


def make_chooser(step_policy: str, config: StepPolicyConfig) -> StepChooser | None:
    """The chooser an engine runs under ``step_policy``: None for ``fixed`` (every decode step
    drafts the commanded number), a fresh one for ``adaptive``."""
    return StepChooser(config) if step_policy == "adaptive" else None


class StepChooser:
    def __init__(self, config: StepPolicyConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.engines: dict[str, Acceptance] = {}  # the engine's acceptance, by draft source
        self.cost = StepCost()
        self.gate = GateState()
        self.requests: dict[str, dict[str, Acceptance]] = {}  # request -> source -> its acceptance
        self.last: StepChoice | None = None
        self.reasons: dict[str, int] = {}
        self.per_sequence_steps = 0  # decode steps whose sequences drafted lengths of their own
        self.choosing = [0, 0.0]  # choices made, and the seconds they took
        self.history: deque[tuple[float, int, int]] = deque()  # (time, k, ceiling) of recent decode steps
        # request -> (lookup draft, tokens of it matched so far): drafts made on steps that did
        # not draft for the request, scored against what it decodes instead (score_shadow)
        self.shadows: dict[str, tuple[list[int], int]] = {}
        self.shadow_trials = 0  # shadow drafts scored

    def prior(self, depth: int, source: str = HEAD) -> list[float]:
        """The engine's acceptance at draft positions 1..depth, of the drafts from ``source``."""
        engine = self.engines.get(source)
        return [self.config.initial_acceptance] * depth if engine is None else \
            engine.estimate(self.config.initial_acceptance, 1.0, depth)

    def estimate(self, request_id: str, prior: list[float], source: str = HEAD) -> list[float]:
        """A request's acceptance by position: its own drafts from ``source``, with the engine's as a prior."""
        own = self.requests.get(request_id, {}).get(source)
        return prior if own is None else own.estimate(prior, self.config.prior_trials, len(prior))

    def choose(self, request_ids: list[str], ceiling: int, backlogs: list[int] | None = None,
               sources: list[str] | None = None, caps: list[int] | None = None) -> StepChoice:
        """This step's choice; ``backlogs``: each request's positions the draft head has yet to
        catch up on (a probe drafts for the requests with the fewest); ``sources``: what drafts
        each request this step (the drafter's ``sources``; None: the head drafts for all);
        ``caps``: each request's own most drafts (None: the ceiling). Prompt lookup's requests
        are scored by shadow drafts (:meth:`wants_shadow`) and never probed."""
        now, started = self.clock(), time.perf_counter()
        sources = sources or [HEAD] * len(request_ids)
        priors = {src: self.prior(ceiling, src) for src in set(sources)}
        acceptances = [self.estimate(r, priors[src], src) for r, src in zip(request_ids, sources, strict=True)]
        choice = choose_steps(ceiling, acceptances, self.cost, self.gate, now, self.config, backlogs,
                              heads=[src == HEAD for src in sources], caps=caps,
                              free=[src == LOOKUP for src in sources],
                              fresh=[src not in self.requests.get(r, {}) for r, src in zip(request_ids, sources, strict=True)])
        self.gate, self.last = choice.gate, choice
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        self.per_sequence_steps += choice.lengths is not None
        self.choosing[0] += 1
        self.choosing[1] += time.perf_counter() - started
        self.history.append((now, choice.num_steps, ceiling))
        while self.history and self.history[0][0] < now - WINDOW_S:
            self.history.popleft()
        return choice

    def observe(self, request_ids: list[str], proposed: list[int], accepted: list[int], live: list[bool], k: int,
                seconds: float, head_s: float = 0.0, head_rows: int = 0, sources: list[str] | None = None,
                fed: int | None = None) -> None:
        """After a decode step of ``k`` drafts that took ``seconds``, ``head_s`` of them in the
        drafter's ``propose``, whose head ran over ``head_rows`` positions: what each request
        proposed and had accepted, drafted from ``sources`` (None: the head for all); ``live``:
        the request still runs (a finished one keeps no estimate); ``fed``: the positions the
        verify fed (None: every request ``1 + k``)."""
        sources = sources or [HEAD] * len(request_ids)
        for rid, p, n, running, src in zip(request_ids, proposed, accepted, live, sources, strict=True):
            if p > 0:
                self._learn(rid, src, p, n, running)
        self.cost.observe(len(request_ids), k, seconds, head_s, head_rows, fed)

    def _learn(self, request_id: str, source: str, proposed: int, accepted: int, running: bool = True) -> None:
        self.engines.setdefault(source, Acceptance(self.config.engine_half_life)).observe(proposed, accepted)
        if running:
            own = self.requests.setdefault(request_id, {})
            own.setdefault(source, Acceptance(self.config.request_half_life)).observe(proposed, accepted)

    def wants_shadow(self, request_id: str) -> bool:
        """Whether the request has no shadow draft being scored: a step that does not draft
        for it may start one (:meth:`shadow`)."""
        return request_id not in self.shadows

    def shadow(self, request_id: str, draft: list[int]) -> None:
        """Prompt lookup's draft for a request this step does not draft for: scored, as a verify
        of it would be, against the tokens the request decodes next (:meth:`decoded`)."""
        if draft and request_id not in self.shadows:
            self.shadows[request_id] = (draft, 0)

    def decoded(self, request_id: str, tokens: list[int]) -> None:
        """The tokens a step appended to a request: its shadow draft, if any, is scored on them,
        and once resolved counts as a verify of prompt lookup's drafts."""
        pending = self.shadows.get(request_id)
        if pending is None or not tokens:
            return
        matched, resolved = score_shadow(pending[0], pending[1], tokens)
        if resolved:
            del self.shadows[request_id]
            self.shadow_trials += 1
            self._learn(request_id, LOOKUP, len(pending[0]), matched)
        else:
            self.shadows[request_id] = (pending[0], matched)

    def cut_short(self, request_id: str, running: bool = True) -> None:
        """End the request's shadow draft before it resolved (the request drafts for real now,
        or ended): the tokens it matched so far count as tried and accepted, and the positions
        after them as untried. Dropping it instead would drop exactly the shadows still
        matching."""
        pending = self.shadows.pop(request_id, None)
        if pending is not None and pending[1] > 0:
            self.shadow_trials += 1
            self._learn(request_id, LOOKUP, pending[1], pending[1], running)

    def release(self, request_id: str) -> None:
        self.cut_short(request_id, running=False)
        self.requests.pop(request_id, None)

    def main_source(self) -> str:
        """The source with the most drafts verified lately (the head before any)."""
        engines = dict(self.engines)  # a copy: load() reads it beside the step thread
        return max(engines, key=lambda src: engines[src].trials[0] if engines[src].trials else 0.0, default=HEAD)

    def _engine_acceptance(self, source: str) -> list[float]:
        engine = self.engines.get(source)
        return [round(a, 4) for a in self.prior(max(1, len(engine.trials) if engine else 1), source)]

    def mean_num_steps(self, ceiling: int) -> float | None:
        """Mean draft length of the decode steps of the last 5 s that ran under ``ceiling``, the
        engine's num_steps now (None: no such step). Steps from before a switch of the ceiling
        do not count: after a switch to 0 the engine chooses nothing and drafts nothing, and
        after a switch from 3 to 1 its steps of 3 drafts are not what it runs now."""
        now = self.clock()
        recent = [k for t, k, c in self.history if t >= now - WINDOW_S and c == ceiling]
        return sum(recent) / len(recent) if recent else None

    def summary(self) -> dict:
        """What the engine decides from, for /v1/speculation: the main draft source's acceptance
        by position, the gate, the choices made by reason (since the chooser started), and the
        learned step cost in ms by "batch,drafts" for the cells seen."""
        return {
            "engine_acceptance": self._engine_acceptance(self.main_source()),
            "gate_shut": self.gate.shut,
            "reasons": dict(self.reasons),
            "step_cost_ms": {f"{b},{k}": round(self.cost.seconds(b, k) * 1000, 2) for b, k in sorted(self.cost.cells)},
        }

    def state(self) -> dict:
        """The summary and the rest the benchmarks and tests read: acceptance by draft source,
        the last choice, the fitted cost's coefficients, and how long a choice takes."""
        base, per_row, per_draft = self.cost.coefficients()
        head_base, head_per_row, head_per_pass = self.cost.head_coefficients()
        return self.summary() | {
            "engine_acceptance_by_source": {src: self._engine_acceptance(src) for src in sorted(self.engines)},
            "last_reason": None if self.last is None else self.last.reason,
            "per_sequence_steps": self.per_sequence_steps,
            "shadow_trials": self.shadow_trials,
            "choose_ms": round(self.choosing[1] / self.choosing[0] * 1000, 3) if self.choosing[0] else None,
            "step_cost_base_s": base,
            "step_cost_per_row_s": per_row,
            "step_cost_per_draft_s": per_draft,
            "head_cost_base_s": head_base,
            "head_cost_per_row_s": head_per_row,
            "head_cost_per_pass_s": head_per_pass,
        }
