"""The cluster simulation: N replicas in fixed time steps of ``dt``, every replica at once.

Each replica holds a FIFO of waiting requests and up to ``max_running`` running ones (slots).
Decoding is fluid: all running requests of a replica gain ``rate(B, k)`` tokens per second
(B = its running count, k = its num_steps), so a replica needs one progress counter and each
request one finish threshold; a step is a handful of numpy operations over (replicas × slots)
whatever the number of tokens. Within a step, finish times are interpolated exactly.

Request classes: a request of class c gains ``rate(B, k) · τ_c(k) / τ(k)`` tokens per second,
τ_c(k) = 1 + a_c + ... + a_c^k its class's tokens per step, τ(k) the curve's: the same step
time T(B, k) = τ(k) / rate(B, k), another yield. Hence one progress counter per (replica,
class). Without classes there is one, accepting as the curve does.

Draft length: the control plane gives each replica its num_steps; under ``two-level`` that is a
ceiling and each replica's engine picks its own k under it every step (``engine_steps.py``).
A speculative engine at k = 0 runs at the curve's ``off_cost``; the static ``off`` policy is a
plain engine.

A request: arrives (trace time), is routed to the less loaded of two random replicas (Ray
Serve's power of two choices on queue length), waits in that replica's FIFO, is admitted into
a free slot, spends the curve's prefill time until its first token, then decodes its output
length. Modes change only through the control plane (see ``control.py``).

One file past 300 lines: the step loop and the figures it reports share the arrays of every
replica and request, and read best side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from serve_app.control.config import ControllerOptions, PolicyConfig
from serve_app.control.steps import StepPolicyConfig, expected_tokens
from serve_app.tools.bench.stats import percentile

from .control import ClusterControl, LocalControl, StaticControl
from .curves import Curve
from .engine_steps import EngineSteps, tokens_table
from .traces import RequestClass, Trace, draw_classes

POLICIES = ("spec", "off", "dynamic", "local", "two-level")


@dataclass
class SimOptions:
    replicas: int = 8
    policy: str = "dynamic"
    """spec | off (fixed modes), dynamic (one cluster-wide controller), local (each replica alone),
    two-level (the cluster-wide num_steps is a ceiling; each engine picks k under it every step)."""
    classes: tuple[RequestClass, ...] | None = None
    """Request classes by share and acceptance; None: one class, accepting as the curve does."""
    step_policy: StepPolicyConfig = field(default_factory=StepPolicyConfig)
    """How a two-level engine picks k (min_gain, the gate's probes)."""
    ceiling: str = "ladder"
    """two-level: ``ladder`` (the cluster ladder's num_steps) or ``top`` (the most steps the
    simulation knows, ``spec_steps`` or the ladder's top, always: the engine alone decides)."""
    spec_steps: int | None = None
    """num_steps of the ``spec`` policy (default: the top tier of the ladder)."""
    dt_s: float = 0.02
    report_delay_s: float = 0.005
    broadcast_delay_s: float = 0.01
    report_answers: bool = True
    """Replicas also take the mode from the answer to their load report (as the real ones do)."""
    max_running: int | None = None
    drain_s: float = 600.0
    seed: int = 0
    slo_tpot_s: float | None = None
    slo_ttft_s: float | None = None
    record: bool = False
    timeline_s: float | None = None
    initial_steps: int | None = None
    host_cores: float | None = None
    """Cores the replicas share with the serving host's work (ingress, HTTP proxy, clients), as
    on one small machine; None: every replica has a core to itself and the host costs nothing."""
    host_s_per_chunk: float = 0.0
    """Host CPU seconds per streamed chunk: one chunk per running request per engine step."""
    stack_efficiency: dict[int, tuple[float | tuple[float, ...], ...]] | None = None
    """The share of the curve's speed (decode rate and prefill) an engine reaches inside the
    serving stack, by num_steps, by how many replicas are busy at once and by how many requests
    the engine runs: ``{k: (e1, e2, ...)}``, entry i for i + 1 busy replicas, the last entry for
    more; an entry is one number (any batch) or a tuple by running requests (entry j for j + 1,
    the last for more); a k not listed takes the nearest listed one. Measured, not derived
    (``validate --stack-efficiency-from``): on one small machine the replica's step thread
    shares the cores with the stack's other threads, which preempt it many times a step
    (docs/simulation.md). None: the curve's speed."""


def by_batch(entry: float | tuple[float, ...]) -> tuple[float, ...]:
    """A ``stack_efficiency`` entry as a tuple by running requests (one number: any batch)."""
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclass
class Requests:
    """Every request of a run, by id."""

    arrival: np.ndarray
    output_tokens: np.ndarray
    hot: np.ndarray
    replica: np.ndarray = field(init=False)
    admit: np.ndarray = field(init=False)
    first: np.ndarray = field(init=False)
    finish: np.ndarray = field(init=False)
    finish_count: np.ndarray = field(init=False)
    cls: np.ndarray = field(init=False)
    """Class index (``SimOptions.classes``)."""

    def __post_init__(self):
        n = len(self.arrival)
        self.finish_count = np.zeros(n, np.int64)
        self.cls = np.zeros(n, np.int64)
        self.replica = np.full(n, -1, np.int64)
        self.admit, self.first, self.finish = (np.full(n, np.inf) for _ in range(3))


class ClosedLoop:
    """``clients`` clients; each sends its next request when the previous one finishes,
    ``total`` requests in all (the benchmark's closed loop). Client j sends its first request
    at j·``stagger_s``/clients (``bench serve --stagger-s``; 0: all at the start)."""

    def __init__(self, clients: int, total: int, output_tokens: int, stagger_s: float = 0.0):
        if stagger_s < 0:
            raise ValueError(f"stagger_s must be >= 0, got {stagger_s}")
        self.clients, self.total, self.output_tokens = clients, max(total, clients), output_tokens
        self.stagger_s = stagger_s


class Simulation:
    def __init__(
        self,
        curve: Curve,
        workload: Trace | ClosedLoop,
        policy: PolicyConfig,
        options: ControllerOptions,
        opts: SimOptions,
    ):
        self.curve, self.workload, self.policy, self.options, self.opts = curve, workload, policy, options, opts
        n = opts.replicas
        self.S = S = opts.max_running or curve.max_running
        self.rng = np.random.default_rng(opts.seed)
        spec = opts.spec_steps if opts.spec_steps is not None else policy.spec_steps
        self.spec_steps = spec
        self.ks = sorted({0, spec, *(t.num_steps for t in policy.tiers)})
        if opts.policy == "two-level":  # the engine may pick any k under the ceiling
            self.ks = list(range(max(self.ks) + 1))
        self.rate_lut, self.prefill_lut = curve.tables(self.ks, S)
        self.plain_rate = self.rate_lut[0].copy()  # a plain engine's (ks[0] = 0)
        if opts.policy != "off" and curve.off_cost:  # a speculative engine at k = 0
            self.rate_lut[0] *= curve.off_speed(np.maximum(np.arange(S + 1), 1))
        self.k_index = np.zeros(max(self.ks) + 1, np.int64)
        self.k_index[self.ks] = np.arange(len(self.ks))
        self.classes = opts.classes or (RequestClass("all", 1.0, None),)
        self.C = len(self.classes)
        tau = np.array([curve.tokens_per_step(k) for k in self.ks])
        self.class_gain = np.ones((len(self.ks), self.C))  # [k index, class]: tokens per step over the curve's
        if opts.classes:
            for c, cls in enumerate(self.classes):
                self.class_gain[:, c] = [expected_tokens(cls.acceptance, k) for k in self.ks] / tau
        self.chunks_per_token = np.array([1.0 / curve.tokens_per_step(k) for k in self.ks])
        self.eff_lut = self._efficiency_table(opts.stack_efficiency, opts.replicas)

        if opts.policy in ("spec", "off"):
            self.control = StaticControl(n, spec if opts.policy == "spec" else 0)
        elif opts.policy in ("dynamic", "two-level"):
            self.control = ClusterControl(
                policy,
                options,
                n,
                self.rng,
                opts.report_delay_s,
                opts.broadcast_delay_s,
                opts.record,
                opts.report_answers,
            )
        elif opts.policy == "local":
            self.control = LocalControl(policy, options, n, self.rng)
        else:
            raise ValueError(f"policy must be one of {POLICIES}, got {opts.policy!r}")
        if opts.initial_steps is not None and opts.policy in ("dynamic", "local", "two-level"):
            loops = self.control.loops if opts.policy == "local" else [self.control.loop]
            for loop in loops:
                loop.num_steps = opts.initial_steps
            self.control.steps[:] = opts.initial_steps

        if isinstance(workload, ClosedLoop):
            total = workload.total
            self.req = Requests(
                np.full(total, np.inf), np.full(total, workload.output_tokens, np.int64), np.zeros(total, bool)
            )
            self.req.arrival[: workload.clients] = np.arange(workload.clients) * workload.stagger_s / workload.clients
            self._issued = workload.clients
            self.hot_n = n
        else:
            self.req = Requests(workload.arrival, workload.output_tokens, workload.hot)
            self._issued = len(workload.arrival)
            self.hot_n = max(1, int(round(workload.hot_fraction * n)))
        if opts.classes:
            self.req.cls = draw_classes(len(self.req.arrival), self.classes, opts.seed)
        self.engine_steps = None
        if opts.policy == "two-level":
            if opts.ceiling not in ("ladder", "top"):
                raise ValueError(f"ceiling must be ladder or top, got {opts.ceiling!r}")
            step_time = tau[:, None] / self.rate_lut  # T(B, k) of the speculative engine, [k, B]
            top = self.ks[-1]  # ks = 0..top
            # the exact acceptance of each class (without classes: the curve's own tokens per step)
            tokens = tokens_table([c.acceptance for c in self.classes], top) if opts.classes else tau[None, :]
            self.engine_steps = EngineSteps(n, step_time, tokens, opts.step_policy)
        self._next_arrival = 0  # open traces: arrivals are sorted; closed loops: ids are issued in order
        self._closed_ready: list[int] = []

        # replica state
        C = self.C
        self.V = np.zeros((n, C))  # progress counter: tokens gained by each running request of a class so far
        self.waiting = np.zeros(n, np.int64)
        self.running = np.zeros(n, np.int64)
        self.decoding = np.zeros(n, np.int64)
        # by class; one class: views of the totals (updated in place), so nothing to keep apart
        self.running_c = np.zeros((n, C), np.int64) if C > 1 else self.running[:, None]
        self.decoding_c = np.zeros((n, C), np.int64) if C > 1 else self.decoding[:, None]
        self.slot_req = np.full((n, S), -1, np.int64)
        self.slot_cls = np.zeros((n, S), np.int64)
        self.thr = np.full((n, S), np.inf)  # finish threshold on V[replica, its class] while decoding
        self.pre_end = np.full((n, S), np.inf)  # end of prefill while prefilling
        self.min_thr = np.full((n, C), np.inf)  # minima, so a step scans only rows with work
        self.min_pre = np.full(n, np.inf)
        self.Q = 64
        self.qbuf = np.zeros((n, self.Q), np.int64)
        self.head = np.zeros(n, np.int64)
        self.tail = np.zeros(n, np.int64)
        self.last_rate = np.zeros((n, C))
        self.k_run = self.control.steps.copy()  # the draft length each replica ran in the last step
        # accounting
        self.decode_tokens = np.zeros(n)  # integral of rate × decoding requests
        self.delivered_tokens = np.zeros(n)
        self.mode_time = np.zeros(len(self.ks))
        self.ceiling_time = np.zeros(len(self.ks))
        self.timeline: list[tuple] = []
        self.history: list[tuple[float, np.ndarray, np.ndarray]] = []  # (t, waiting, running) when recording
        self.t = 0.0
        self.wall_s = 0.0

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Simulation:
        start = time.perf_counter()
        dt, opts = self.opts.dt_s, self.opts
        end = (self.workload.duration_s if isinstance(self.workload, Trace) else 0.0) + opts.drain_s
        bucket = opts.timeline_s or max(1.0, end / 600)
        next_bucket, tokens_at_bucket = bucket, 0.0
        t, n_total = 0.0, len(self.req.arrival)
        while True:
            self._arrivals(t)
            if self.waiting.any():
                self._admit(t)
            self._prefills_done(t)
            self.control.step(t, self.waiting, self.running)
            ceiling = self.control.steps
            if self.engine_steps is not None:
                if opts.ceiling == "top":
                    ceiling = np.full(len(ceiling), self.ks[-1])
                self.ceiling_time += np.bincount(self.k_index[ceiling], minlength=len(self.ks)) * dt
                self.k_run = self.engine_steps.choose(t, ceiling, self.running_c)
            else:
                self.k_run = ceiling
            kidx = self.k_index[self.k_run]
            if opts.record:
                self.history.append((t, self.waiting.copy(), self.running.copy()))
            self._decode(t, dt, kidx)
            self.mode_time += np.bincount(kidx, minlength=len(self.ks)) * dt
            t = round(t + dt, 9)
            if t >= next_bucket:
                tok = self.decode_tokens.sum()
                self.timeline.append(
                    (
                        t,
                        float((self.waiting + self.running).mean()),
                        float(self.k_run.mean()),
                        (tok - tokens_at_bucket) / bucket,
                    )
                )
                next_bucket, tokens_at_bucket = next_bucket + bucket, tok
            if isinstance(self.workload, ClosedLoop):
                done = self._issued >= n_total and self._next_arrival >= self.workload.clients
            else:
                done = self._next_arrival >= n_total
            done = done and not self._closed_ready
            if (done and not self.running.any() and not self.waiting.any()) or t > end:
                break
        self.t = t
        self.wall_s = time.perf_counter() - start
        return self

    def _arrivals(self, t: float) -> None:
        req = self.req
        if isinstance(self.workload, ClosedLoop):
            ids = np.array(self._closed_ready, np.int64)
            self._closed_ready = []
            if self._next_arrival < self.workload.clients:  # the first wave, as each client starts
                stop = int(np.searchsorted(req.arrival[: self.workload.clients], t, side="right"))
                ids = np.concatenate([np.arange(self._next_arrival, stop), ids])
                self._next_arrival = stop
        else:
            if self._next_arrival >= len(req.arrival) or req.arrival[self._next_arrival] > t:
                return
            stop = np.searchsorted(req.arrival, t, side="right")
            ids = np.arange(self._next_arrival, stop)
            self._next_arrival = stop
        if len(ids) == 0:
            return
        # Power of two choices, one request after the other (a router sees its own assignments).
        m = len(ids)
        pool = np.where(req.hot[ids], self.hot_n, self.opts.replicas)
        a = (self.rng.random(m) * pool).astype(np.int64)
        b = (a + 1 + (self.rng.random(m) * np.maximum(pool - 1, 1)).astype(np.int64)) % pool
        q = (self.waiting + self.running).tolist()
        pick = []
        for x, y, coin in zip(a.tolist(), b.tolist(), (self.rng.random(m) < 0.5).tolist(), strict=True):
            r = x if q[x] < q[y] or (q[x] == q[y] and coin) else y
            q[r] += 1
            pick.append(r)
        pick = np.array(pick, np.int64)
        req.replica[ids] = pick
        self._enqueue(ids, pick)

    def _enqueue(self, ids: np.ndarray, reps: np.ndarray) -> None:
        order = np.argsort(reps, kind="stable")
        ids, reps = ids[order], reps[order]
        counts = np.bincount(reps, minlength=self.opts.replicas)
        need = int((self.tail - self.head + counts).max())
        if need > self.Q:
            self._grow(need)
        starts = np.cumsum(counts) - counts
        rank = np.arange(len(ids)) - starts[reps]
        self.qbuf[reps, (self.tail[reps] + rank) % self.Q] = ids
        self.tail += counts
        self.waiting += counts

    def _grow(self, need: int) -> None:
        Q = max(need, 2 * self.Q)
        buf = np.zeros((self.opts.replicas, Q), np.int64)
        for r in range(self.opts.replicas):
            idx = np.arange(self.head[r], self.tail[r])
            buf[r, idx % Q] = self.qbuf[r, idx % self.Q]
        self.qbuf, self.Q = buf, Q

    def _admit(self, t: float) -> None:
        n_adm = np.minimum(self.S - self.running, self.waiting)
        rows = np.nonzero(n_adm)[0]
        if len(rows) == 0:
            return
        k = n_adm[rows]
        reps = np.repeat(rows, k)
        rank = np.arange(len(reps)) - np.repeat(np.cumsum(k) - k, k)
        ids = self.qbuf[reps, (self.head[reps] + rank) % self.Q]
        free = self.slot_req[rows] < 0
        pick = free & (np.cumsum(free, axis=1) <= k[:, None])
        r_local, cols = np.nonzero(pick)
        slot_rows = rows[r_local]  # row-major order: grouped by replica like ``ids``
        kidx = self.k_index[self.k_run[slot_rows]]
        self.slot_req[slot_rows, cols] = ids
        self.slot_cls[slot_rows, cols] = cls = self.req.cls[ids]
        if self.C > 1:
            np.add.at(self.running_c, (slot_rows, cls), 1)
        batch = np.repeat(self.running[rows] + k, k)  # prefill at the batch it joins
        prefill = self.prefill_lut[kidx, batch]
        if self.opts.stack_efficiency:
            busy = np.count_nonzero(self.running) + np.count_nonzero(self.running[rows] == 0)
            prefill = prefill / self.eff_lut[kidx, busy, batch]
        self.pre_end[slot_rows, cols] = ends = t + prefill
        np.minimum.at(self.min_pre, slot_rows, ends)
        self.req.admit[ids] = t
        self.head[rows] += k
        self.waiting[rows] -= k
        self.running[rows] += k

    def _prefills_done(self, t: float) -> None:
        hit = np.nonzero(self.min_pre <= t)[0]
        if len(hit) == 0:
            return
        r_local, cols = np.nonzero(self.pre_end[hit] <= t)
        rows = hit[r_local]
        ids = self.slot_req[rows, cols]
        cls = self.slot_cls[rows, cols]
        ended = self.pre_end[rows, cols]
        self.req.first[ids] = ended
        # decoding began at the end of prefill, inside the last step: credit that part
        credit = self.last_rate[rows, cls] * (t - ended)
        self.thr[rows, cols] = self.V[rows, cls] + self.req.output_tokens[ids] - credit
        self.pre_end[rows, cols] = np.inf
        self.min_pre[hit] = self.pre_end[hit].min(axis=1)
        np.minimum.at(self.min_thr, (rows, cls), self.thr[rows, cols])
        np.add.at(self.decoding, rows, 1)
        if self.C > 1:
            np.add.at(self.decoding_c, (rows, cls), 1)

    def _decode(self, t: float, dt: float, kidx: np.ndarray) -> None:
        rate = self.rate_lut[kidx, self.running]
        if self.opts.stack_efficiency:
            rate = rate * self.eff_lut[kidx, np.count_nonzero(self.running), self.running]
        if self.opts.host_cores:
            rate = rate * self._host_share(rate, kidx)
        rate = rate[:, None] * self.class_gain[kidx]  # (replicas, classes)
        gain = rate * dt
        V0 = self.V
        V1 = V0 + gain
        self.decode_tokens += gain[:, 0] * self.decoding if self.C == 1 else (gain * self.decoding_c).sum(axis=1)
        self.last_rate = rate
        reached = self.min_thr <= V1
        hit = np.nonzero(reached[:, 0] if self.C == 1 else reached.any(axis=1))[0]
        if len(hit):
            Vh = V1[hit] if self.C == 1 else np.take_along_axis(V1[hit], self.slot_cls[hit], axis=1)
            r_local, cols = np.nonzero(self.thr[hit] <= Vh)
            rows = hit[r_local]
            ids = self.slot_req[rows, cols]
            cls = self.slot_cls[rows, cols]
            frac = np.clip((self.thr[rows, cols] - V0[rows, cls]) / gain[rows, cls], 0.0, 1.0)
            finish = t + frac * dt
            self.req.finish[ids] = finish
            np.add.at(self.req.finish_count, ids, 1)
            self.slot_req[rows, cols] = -1
            self.thr[rows, cols] = np.inf
            if self.C == 1:
                self.min_thr[hit, 0] = self.thr[hit].min(axis=1)
            else:
                for c in range(self.C):
                    self.min_thr[hit, c] = np.where(self.slot_cls[hit] == c, self.thr[hit], np.inf).min(axis=1)
            counts = np.bincount(rows, minlength=self.opts.replicas)
            self.running -= counts
            self.decoding -= counts
            if self.C > 1:
                np.subtract.at(self.running_c, (rows, cls), 1)
                np.subtract.at(self.decoding_c, (rows, cls), 1)
            np.add.at(self.delivered_tokens, rows, self.req.output_tokens[ids])
            if isinstance(self.workload, ClosedLoop):
                self._reissue(ids, finish)
        self.V = V1

    def _efficiency_table(self, eff, replicas: int) -> np.ndarray:
        """``stack_efficiency`` as [k index, busy replicas, running requests] (1 everywhere
        without it)."""
        table = np.ones((len(self.ks), replicas + 1, self.S + 1))
        if not eff:
            return table
        listed = sorted(eff)
        for i, k in enumerate(self.ks):
            row = eff[min(listed, key=lambda m: (abs(m - k), m))]
            for busy in range(1, replicas + 1):
                e = by_batch(row[min(busy, len(row)) - 1])
                table[i, busy, 1:] = [e[min(b, len(e)) - 1] for b in range(1, self.S + 1)]
        return table

    def tokens_between(self, t0: float, t1: float) -> float:
        """Output tokens decoded in [t0, t1) (needs ``timeline_s`` no coarser than the window)."""
        bucket = self.opts.timeline_s or 0.0
        return float(sum(tok * bucket for end, _, _, tok in self.timeline if t0 < end - bucket / 2 < t1))

    def _host_share(self, rate: np.ndarray, kidx: np.ndarray) -> float:
        """The share of full speed the machine's cores allow: each busy replica's engine wants a
        core, the host ``host_s_per_chunk`` per chunk it streams; past ``host_cores`` every one
        of them slows alike (both demands scale with speed, so the share is cores / demand)."""
        engines = float(np.count_nonzero(self.running))
        chunks_per_s = float((rate * self.decoding * self.chunks_per_token[kidx]).sum())
        demand = engines + self.opts.host_s_per_chunk * chunks_per_s
        return min(1.0, self.opts.host_cores / demand) if demand > 0 else 1.0

    def _reissue(self, done: np.ndarray, finish: np.ndarray) -> None:
        left = self.workload.total - self._issued
        if left <= 0:
            return
        new = np.arange(self._issued, self._issued + min(left, len(done)))
        self.req.arrival[new] = finish[np.argsort(finish)][: len(new)]
        self._issued += len(new)
        self._closed_ready.extend(new.tolist())

    # -- results ----------------------------------------------------------------------------

    def summary(self) -> dict:
        req, opts = self.req, self.opts
        issued = np.isfinite(req.arrival)
        fin = np.isfinite(req.finish)
        n = req.output_tokens
        tokens = int(n[fin].sum())
        t0 = float(req.arrival[issued].min()) if issued.any() else 0.0
        makespan = float(req.finish[fin].max() - t0) if fin.any() else 0.0
        ttft = (req.first - req.arrival)[fin]
        multi = fin & (n > 1)
        tpot = ((req.finish - req.first) / np.maximum(n - 1, 1))[multi]
        slo_tpot = opts.slo_tpot_s or self.default_slo_tpot()
        good = fin & (((req.finish - req.first) / np.maximum(n - 1, 1)) <= slo_tpot)
        if opts.slo_ttft_s:
            good &= (req.first - req.arrival) <= opts.slo_ttft_s
        pct = lambda x, q: round(percentile(x, q) * 1000, 2) if len(x) else None  # noqa: E731
        out = {
            "policy": opts.policy,
            "replicas": opts.replicas,
            "requests": int(issued.sum()),
            "finished": int(fin.sum()),
            "output_tokens": tokens,
            "sim_time_s": round(self.t, 3),
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(tokens / makespan, 2) if makespan else 0.0,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99),
            "goodput_tokens_per_s": round(float(n[good].sum()) / makespan, 2) if makespan else 0.0,
            "slo_tpot_ms": round(slo_tpot * 1000, 2),
            "slo_ttft_ms": None if not opts.slo_ttft_s else opts.slo_ttft_s * 1000,
            "switches": int(self.control.switches),
            "time_in_mode": {
                str(k): round(float(v / max(self.mode_time.sum(), 1e-9)), 4)
                for k, v in zip(self.ks, self.mode_time, strict=True)
            },
        }
        if self.engine_steps is not None:
            out["time_in_ceiling"] = {
                str(k): round(float(v / max(self.ceiling_time.sum(), 1e-9)), 4)
                for k, v in zip(self.ks, self.ceiling_time, strict=True)
            }
        if self.opts.classes:
            tpot_all = (req.finish - req.first) / np.maximum(n - 1, 1)
            out["classes"] = {}
            for c, cls in enumerate(self.classes):
                sel = fin & (req.cls == c)
                out["classes"][cls.name] = {
                    "share": round(cls.share, 4),
                    "acceptance": cls.acceptance,
                    "requests": int(sel.sum()),
                    "tpot_p50_ms": pct(tpot_all[sel & multi], 50),
                    "goodput_tokens_per_s": round(float(n[good & sel].sum()) / makespan, 2) if makespan else 0.0,
                }
        phases = getattr(self.workload, "phases", None)
        if phases:
            for name in ("low", "high"):
                mask = np.zeros(len(n), bool)
                for a, b, p in phases:
                    if p == name:
                        mask |= (req.arrival >= a) & (req.arrival < b)
                sel = mask & multi
                out[f"tpot_p50_{name}_load_ms"] = pct(((req.finish - req.first) / np.maximum(n - 1, 1))[sel], 50)
        if isinstance(self.control, ClusterControl):
            out["propagation"] = self.control.loop.propagation_stats()
        return out

    def default_slo_tpot(self) -> float:
        """TPOT of plain decode with half the slots busy (the engine loaded but not saturated)."""
        return float(1.0 / self.plain_rate[max(1, self.S // 2)])
