"""How an ingress picks the replica for a request: the one with the fewest requests it has
sent there and not seen finish, counting the choices it made and has not sent yet.

Serve's default router (power of two choices) keeps a cache of each replica's queue length
that it raises when it sends a request and overwrites with the length a replica reports when
it accepts one. A routing task that finds both lengths cached routes the next pending request
without waiting, before the request it just routed is sent and counted, so the requests of a
burst that queues up in the router within one turn of its event loop all see the same
lengths: they go to the shorter queue, or at random between equal ones; and a replica's
report, taken before the requests sent to it since have arrived, lowers its count again.
Requests of one length that start together end together, so under plain decoding a closed
loop of clients sends such bursts all the time: a replica ran 25 requests and the other 7 for
a whole wave of 32 clients (docs/benchmarks.md).

This router counts what it sends (``on_send_request``, then ``on_request_completed`` when the
request ends, however it ends) plus the choices it has made and not yet sent, so every choice
in a burst sees the ones before it. It ranks every replica by that count (ties in random
order), so a replica that refuses a request (Serve's ``max_ongoing_requests``) passes it to
the next; when all refuse, the routing task backs off as Serve's own router does. Each
ingress balances its own requests; with one ingress per node, the replicas' totals are the
sum of balanced shares.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict, deque

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

CHOSEN_TTL_S = 5.0
"""How long a choice counts before its request is sent: a choice whose request went to another
replica (this one refused it) or was cancelled stops counting after this. Sending takes a call
to the replica, which on a loaded 2-core host took over a second: a burst's later choices then
no longer saw the earlier ones (16 requests split 6 and 10 with 1 s)."""


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    """Ranks the replicas by the requests this router has in flight on each (see the module)."""

    def initialize_state(self, **kwargs) -> None:
        self._sent: Counter[ReplicaID] = Counter()
        self._chosen: defaultdict[ReplicaID, deque[float]] = defaultdict(deque)

    def load(self, replica_id: ReplicaID, now: float | None = None) -> int:
        """Requests sent to ``replica_id`` and not finished, plus choices of it not yet sent."""
        now = time.monotonic() if now is None else now
        chosen = self._chosen.get(replica_id)
        while chosen and now - chosen[0] > CHOSEN_TTL_S:
            chosen.popleft()
        return self._sent[replica_id] + len(chosen or ())

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # back off between rounds in which every replica refused
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        now = time.monotonic()
        ranked = sorted(candidate_replicas, key=lambda r: (self.load(r.replica_id, now), random.random()))
        self._chosen[ranked[0].replica_id].append(now)
        return [[r] for r in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        chosen = self._chosen.get(replica_id)
        if chosen:
            chosen.popleft()
        self._sent[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._sent[replica_id] > 1:
            self._sent[replica_id] -= 1
        else:
            self._sent.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in {*self._sent, *self._chosen} - live:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._sent.pop(replica_id, None)
        self._chosen.pop(replica_id, None)
