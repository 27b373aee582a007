"""The engine's step loop, synchronous and single-threaded: schedule, run, postprocess.

``EngineCore.step()`` prefills what the scheduler admits, then runs one decode step for
every decoding sequence. The step reads ``num_steps`` once, at its start: that is the
switch point. With a :class:`StepChooser` (``step_policy: adaptive``) ``num_steps`` is a
ceiling, and each decode step drafts the number under it that the chooser picks, one for
the batch or (``per_sequence``) one for each sequence.

A step of 0 drafts feeds each sequence its last token; k > 0 feeds the last token plus up
to k draft tokens and keeps the longest verified prefix; the verify feeds each sequence only
its own drafts (``Llama.forward``'s ``fed``). Either way a sequence's cache ends
the step holding exactly its tokens but the newest one, so the next step can use either
path.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import torch

from ..base import TokenDelta
from .adaptive import HEAD, LOOKUP, StepChooser
from .drafters import Drafter
from .kv_cache import KVCache
from .logits import Logprobs
from .model import Llama
from .sampler import greedy_verify, probs_from_logits, rejection_sample, sample
from .scheduler import Scheduler
from .sequence import IncrementalDetokenizer, Sequence, Status

log = logging.getLogger(__name__)


class StepStats:
    """Rolling counters for load(): output tokens/s and draft acceptance."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.events: deque[tuple[float, int, int, int, int]] = deque()  # t, tokens, proposed, accepted, verifies

    def record(self, tokens: int, proposed: int = 0, accepted: int = 0, verifies: int = 0) -> None:
        now = time.monotonic()
        self.events.append((now, tokens, proposed, accepted, verifies))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window_s:
            self.events.popleft()

    def snapshot(self) -> tuple[float, float, float]:
        """(output tokens/s, accept rate, mean accepted draft tokens per verify)."""
        now = time.monotonic()
        self._trim(now)
        events = list(self.events)
        if not events:
            return 0.0, 0.0, 0.0
        span = max(now - events[0][0], 1e-3) if len(events) > 1 else self.window_s
        tokens = sum(e[1] for e in events)
        proposed, accepted, verifies = (sum(e[i] for e in events) for i in (2, 3, 4))
        return (tokens / span, accepted / proposed if proposed else 0.0,
                accepted / verifies if verifies else 0.0)


class EngineCore:
    def __init__(self, model: Llama, tokenizer, drafter: Drafter, cache: KVCache, *,
                 max_num_seqs: int, max_prefill_tokens: int, eos_token_ids: set[int],
                 chooser: StepChooser | None = None):
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.cache = cache
        self.scheduler = Scheduler(cache, max_num_seqs, max_prefill_tokens)
        self.eos_token_ids = eos_token_ids
        self.num_steps = 0  # the ceiling: the most drafts a step may verify
        self.chooser = chooser  # None: every step drafts num_steps; else it picks under it
        self.last_num_steps = 0  # what the last decode step drafted
        self.last_ceiling = 0  # the num_steps that step ran under
        self.stats = StepStats()
        self.totals = {"proposed": 0, "accepted": 0, "verifies": 0, "steps": 0, "output_tokens": 0}
        self.verify_counts: Counter[tuple[int, int]] = Counter()  # (drafts verified, accepted) -> verifies
        self.device = model.device
        # Layers whose inputs a hidden-state drafter reads; None: the plain final hidden.
        self.taps = getattr(drafter, "feature_layers", None) if drafter.needs_hidden else None
        self.logprobs = Logprobs(tokenizer)

    # -- requests ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, seq.params.stop)
        self.scheduler.add(seq)

    @torch.inference_mode()  # the cache's tensors are inference tensors: moving a slot writes them
    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None and seq.status is not Status.FINISHED:
            self._finish(seq, "abort")
            self.scheduler.remove_finished()

    def abort_all(self) -> None:
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.abort(seq.request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_num_steps(self) -> int:
        """The drafts the engine runs now: its last decode step's, where that step ran under
        the num_steps of now; else (none has run since num_steps changed) num_steps itself."""
        return self.last_num_steps if self.last_ceiling == self.num_steps else self.num_steps

    # -- the loop ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        num_steps = self.num_steps  # read once: a switch lands between steps
        batch = self.scheduler.schedule_prefill()
        if batch:
            self._prefill(batch)
            self.scheduler.remove_finished()  # a request may end at its first token: not decoded again
        seqs = self.scheduler.decoding()
        if seqs:
            self._decode(seqs, num_steps)
        self.scheduler.remove_finished()
        self.totals["steps"] += 1

    def _prefill(self, batch: list[tuple[Sequence, int]]) -> None:
        width = max(n for _, n in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (seq, n) in enumerate(batch):
            tokens[row, :n] = torch.tensor(seq.token_ids[seq.num_cached:seq.num_cached + n])
        lens = torch.tensor([seq.num_cached for seq, _ in batch])
        last = torch.tensor([[n - 1] for _, n in batch])
        every = any(seq.params.prompt_logprobs is not None for seq, _ in batch)
        # Logits at every position where a request asks for its prompt's logprobs; else the last.
        index = torch.minimum(torch.arange(width)[None, :], last) if every else last
        logits, hidden = self.model.forward(tokens.to(self.device), lens.to(self.device), self.cache,
                                            slot0=batch[0][0].slot, logit_index=index.to(self.device), taps=self.taps)
        if every:
            for row, (seq, n) in enumerate(batch):
                if seq.params.prompt_logprobs is not None:
                    self._prompt_logprobs(seq, n, logits[row])
            logits = logits[torch.arange(len(batch))[:, None], last]
        finishing = [(row, seq) for row, (seq, n) in enumerate(batch) if seq.num_cached + n >= seq.num_prompt_tokens]
        raw = self._raw_rows(finishing, logits, [1] * len(batch))
        self._process([seq for seq, _ in batch], logits, [[] for _ in batch])
        emitted = 0
        for row, (seq, n) in enumerate(batch):
            seq.num_cached += n
            if seq.num_cached < seq.num_prompt_tokens:
                continue
            seq.status = Status.DECODING
            emitted += self._append(seq, [self._sample_one(seq, logits[row, 0])], raw.get(row))
        if self.drafter.needs_hidden:
            self._observe([s for s, _ in batch], hidden, [n for _, n in batch])
        self.stats.record(emitted)

    def _prompt_logprobs(self, seq: Sequence, n: int, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens that this chunk's ``n`` positions predict."""
        start = seq.num_cached
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [self.logprobs.entry(seq.token_ids[0], None)]
        targets = seq.token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
        seq.prompt_logprobs.extend(self.logprobs.entries(logits, targets, seq.params.prompt_logprobs))

    def _raw_rows(self, rows: list[tuple[int, Sequence]], logits: torch.Tensor, widths: list[int]) -> dict:
        """The logits as the model gave them, of the rows whose requests want logprobs, before
        penalties and bans change them."""
        return {row: logits[row, :widths[row]].clone() for row, seq in rows if seq.params.logprobs is not None}

    def _decode(self, seqs: list[Sequence], ceiling: int) -> None:
        started = time.perf_counter()
        num_steps, rows = ceiling, range(len(seqs))
        ids = [s.request_id for s in seqs]
        # Never draft past what a request may still output, nor past its own cap.
        caps = [min(ceiling, s.params.max_tokens - s.num_output_tokens - 1,
                    ceiling if s.params.spec_max_steps is None else s.params.spec_max_steps)
                for s in seqs] if ceiling > 0 else []
        backlogs = sources = None
        own_caps = caps
        if ceiling > 0 and self.chooser is not None:
            # A sequence the lookup drafts runs no head: nothing to catch up on, no head cost.
            sources = self.drafter.sources(ids, [s.token_ids for s in seqs])
            backlogs = [b if src == HEAD else 0
                        for b, src in zip(self.drafter.backlog(ids), sources, strict=True)]
            choice = self.chooser.choose(ids, ceiling, backlogs, sources, caps)
            num_steps = choice.num_steps
            rows = rows if choice.rows is None else choice.rows  # a probe drafts for a few
            if choice.lengths is not None:  # each its own length: the ones that draft
                caps = [min(c, n) for c, n in zip(caps, choice.lengths, strict=True)]
                rows = [r for r in rows if caps[r] > 0]
        self.last_num_steps, self.last_ceiling = num_steps, ceiling
        drafts: list[list[int]] = [[] for _ in seqs]
        head_s, head_rows = 0.0, 0
        if num_steps > 0 and rows:
            limits = [min(num_steps, caps[r]) for r in rows]
            if sources is not None:  # the positions the head runs over: its rows' catch-up and drafts
                head = [r for r in rows if sources[r] == HEAD]
                head_rows = sum(backlogs[r] for r in head) + len(head) * num_steps
            head_started = time.perf_counter()
            proposed = self.drafter.propose([ids[r] for r in rows], [seqs[r].token_ids for r in rows], num_steps)
            head_s = time.perf_counter() - head_started
            for r, d, lim in zip(rows, proposed, limits, strict=True):
                drafts[r] = d[:max(lim, 0)]
        if sources is not None:
            self._shadow(seqs, sources, own_caps, drafts, ceiling, set(rows) if num_steps > 0 else set())
        width = 1 + max(len(d) for d in drafts)
        tokens = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            tokens[row, :1 + len(draft)] = torch.tensor([seq.token_ids[-1], *draft])
        lens = torch.tensor([s.num_cached for s in seqs])
        fed = [1 + len(d) for d in drafts]  # each sequence is fed only its own drafts: a ragged verify
        logits, hidden = self.model.forward(tokens.to(self.device), lens.to(self.device), self.cache, taps=self.taps,
                                            fed=fed)
        raw = self._raw_rows(list(enumerate(seqs)), logits, fed)
        self._process(seqs, logits, drafts)
        greedy_argmax = logits.argmax(dim=-1).tolist()
        emitted = proposed_n = accepted_n = verifies = 0
        accepted_per_seq = []
        for row, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.params.temperature == 0:
                out, n = greedy_verify(draft, greedy_argmax[row][:len(draft) + 1])
            else:
                probs = probs_from_logits(logits[row, :len(draft) + 1], seq.params.temperature, seq.params.top_p)
                out, n = rejection_sample(draft, None, probs, seq.generator)
            seq.num_cached += 1 + n
            accepted_per_seq.append(n)
            if self.chooser is not None:
                self.chooser.decoded(seq.request_id, out)
            if draft:  # counted before the output goes out, so a finished client sees its step
                proposed_n, accepted_n, verifies = proposed_n + len(draft), accepted_n + n, verifies + 1
                self.totals["proposed"] += len(draft)
                self.totals["accepted"] += n
                self.totals["verifies"] += 1
                self.verify_counts[len(draft), n] += 1
            emitted += self._append(seq, out, raw.get(row))
        if self.drafter.needs_hidden:
            self._observe(seqs, hidden, [1 + n for n in accepted_per_seq])
        self.stats.record(emitted, proposed_n, accepted_n, verifies)
        if self.chooser is not None:
            live = [s.status is not Status.FINISHED for s in seqs]
            self.chooser.observe(ids, [len(d) for d in drafts], accepted_per_seq, live, width - 1,
                                 time.perf_counter() - started, head_s, head_rows, sources,
                                 sum(fed))

    def _shadow(self, seqs: list[Sequence], sources: list[str], caps: list[int], drafts: list[list[int]],
                ceiling: int, proposed: set[int]) -> None:
        """Prompt lookup's sequences this step does not draft for get a shadow draft, scored
        against the tokens they decode instead: their acceptance estimates keep moving at no
        cost while the gate is shut or their own length is 0. A sequence that drafts now ends
        its shadow draft (the verify measures it); one the drafter was asked for and found no
        match gets none."""
        for r, draft in enumerate(drafts):
            if draft:
                self.chooser.cut_short(seqs[r].request_id)
        rows = [r for r, seq in enumerate(seqs) if sources[r] == LOOKUP and not drafts[r] and caps[r] > 0
                and r not in proposed and self.chooser.wants_shadow(seq.request_id)]
        if rows:
            made = self.drafter.lookup_drafts([seqs[r].request_id for r in rows], [seqs[r].token_ids for r in rows],
                                              ceiling)
            for r, d in zip(rows, made, strict=True):
                self.chooser.shadow(seqs[r].request_id, d[:caps[r]])

    def _observe(self, seqs: list[Sequence], hidden: torch.Tensor, num_valid: list[int]) -> None:
        """Hand the drafter the hidden states of the sequences still running (finished ones are released)."""
        live = [r for r, s in enumerate(seqs) if s.status is not Status.FINISHED]
        if live:
            rows = hidden if len(live) == len(seqs) else hidden[live]
            self.drafter.observe([seqs[r].request_id for r in live], rows, [num_valid[r] for r in live])

    # -- output -----------------------------------------------------------------------
    def _process(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]]) -> None:
        """Penalties, bias and ``min_tokens`` bans, at each row's fed positions."""
        for row, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
            if seq.logits_state is not None:
                seq.logits_state.apply(logits[row, :1 + len(draft)], draft)
        self._ban_early_stops(seqs, logits)

    def _ban_early_stops(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """``min_tokens``: end-of-sequence and ``stop_token_ids`` get no probability at the step's
        positions that come before a request's ``min_tokens``-th output token, a verified
        draft's positions as well, so speculation changes nothing."""
        for row, seq in enumerate(seqs):
            short = seq.params.min_tokens - seq.num_output_tokens
            if short <= 0:
                continue
            banned = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
            banned = sorted(i for i in banned if i < logits.shape[-1])
            if banned:
                logits[row, :short, banned] = float("-inf")

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        if seq.params.temperature == 0:
            return int(logits.argmax())
        return sample(probs_from_logits(logits, seq.params.temperature, seq.params.top_p), seq.generator)

    def _append(self, seq: Sequence, tokens: list[int], raw: torch.Tensor | None = None) -> int:
        """Append tokens one at a time, stopping exactly where plain decoding would. ``raw``: the
        model's logits at the tokens' positions, for their logprobs."""
        first = seq.num_output_tokens == 0
        added: list[int] = []
        text, reason = "", None
        for t in tokens:
            seq.token_ids.append(t)
            added.append(t)
            if (t in self.eos_token_ids and not seq.params.ignore_eos) or t in seq.params.stop_token_ids:
                reason = "stop"
                break
            piece, hit_stop = seq.detok.add([t], check_stop=seq.num_output_tokens >= seq.params.min_tokens)
            text += piece
            if hit_stop:
                reason = "stop"
                break
            if seq.num_output_tokens >= seq.params.max_tokens:
                reason = "length"
                break
        if reason is not None:
            text += seq.detok.flush()
        self.totals["output_tokens"] += len(added)
        if seq.logits_state is not None:
            seq.logits_state.append(added)
        if reason is not None:  # before the output goes out: a client that sees its end sees it finished
            self._release(seq, reason)
        delta = TokenDelta(seq.request_id, added, text, reason, seq.num_prompt_tokens, seq.num_output_tokens)
        if seq.params.logprobs is not None and raw is not None:
            delta.logprobs = self.logprobs.entries(raw, added, seq.params.logprobs)
        if first:
            delta.prompt_text, delta.prompt_logprobs = seq.prompt_text, seq.prompt_logprobs
        seq.emit(delta)
        return len(added)

    def _release(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.drafter.release(seq.request_id)
        if self.chooser is not None:
            self.chooser.release(seq.request_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq, reason)
        seq.emit(TokenDelta(seq.request_id, [], "", reason, seq.num_prompt_tokens, seq.num_output_tokens))
