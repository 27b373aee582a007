"""The controller: one named, detached, restartable Ray actor per application around a
:class:`~serve_app.control.loop.ControlLoop`. It ticks the loop, answers the replicas'
long-polls, broadcasts each switch to the replica deployment, exports metrics, and keeps its
state in Ray's internal KV store so that a restarted controller comes back with its mode,
override, policy and events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from typing import Any

from serve_app.control.config import ControllerOptions, PolicyConfig
from serve_app.control.loop import ControlLoop, ReplicaReport, SwitchEvent

logger = logging.getLogger(__name__)

NAMESPACE = "specserve"


def controller_name(app_name: str) -> str:
    """The Ray actor name of an application's controller (in namespace ``specserve``)."""
    return f"specserve-controller:{app_name}"


def _kv_key(app_name: str) -> bytes:
    return f"specserve/controller/{app_name}".encode()


class ModeController:
    """One per application: a named, detached, restartable Ray actor around a ControlLoop.

    Create it with :func:`get_or_create_controller`; do not instantiate it directly.
    """

    async def __init__(self, app_name: str, deployment_name: str, policy: dict, options: dict):
        from ray.experimental import internal_kv

        from serve_app.control.metrics import controller_metrics

        self._kv = internal_kv
        self._app_name = app_name
        self._deployment_name = deployment_name
        self._metrics = controller_metrics(app_name)
        self._waiters: set[asyncio.Future] = set()
        self._loop = self._load(PolicyConfig.model_validate(policy), ControllerOptions.model_validate(options))
        self._annotator = None
        if self._loop.options.grafana is not None:
            from serve_app.control.annotations import GrafanaAnnotator

            self._annotator = GrafanaAnnotator(app_name, self._loop.options.grafana, self._metrics)
        self._ticker = asyncio.create_task(self._run())
        # Importing Serve and making a handle takes ~1 s: do it now, off the loop that
        # answers long-polls, rather than at the first switch.
        self._handle = asyncio.ensure_future(asyncio.to_thread(self._deployment_handle))

    def _deployment_handle(self):
        from ray import serve

        return serve.get_deployment_handle(self._deployment_name, self._app_name)

    def _load(self, policy: PolicyConfig, options: ControllerOptions) -> ControlLoop:
        raw = self._kv._internal_kv_get(_kv_key(self._app_name))
        if raw is None:
            return ControlLoop(policy, options)
        try:
            loop = ControlLoop.from_persisted(json.loads(raw), policy, options)
            logger.info("controller %s restored at version %d", self._app_name, loop.version)
            return loop
        except Exception:  # a state from an incompatible version must not wedge the app
            logger.exception("controller %s: persisted state unreadable, starting fresh", self._app_name)
            return ControlLoop(policy, options)

    def _save(self) -> None:
        self._kv._internal_kv_put(_kv_key(self._app_name), json.dumps(self._loop.to_persisted()), overwrite=True)

    async def _run(self) -> None:
        while True:
            # Decide on a clock of its own: with slow reports the policy still sees the load
            # (as last reported) often enough to measure dwell.
            await asyncio.sleep(self._loop.options.decision_interval_s)
            try:
                now = time.time()
                started = time.perf_counter()
                event = self._loop.tick(now)
                self._metrics.observe_decision(time.perf_counter() - started)
                self._after(event)
                queue, n = self._loop.cluster_queue(now)
                bounds = [(t.below, t.num_steps) for t in self._loop.policy.tiers[:-1]]
                self._metrics.observe_state(self._loop.num_steps, queue, n, bounds)
            except Exception:
                logger.exception("controller tick failed")

    def _after(self, event: SwitchEvent | None) -> None:
        """Publish a switch (if any) and record propagations that completed."""
        if event is not None:
            logger.info("switch %d -> %d (%s: %s)", event.from_steps, event.to_steps, event.reason, event.detail)
            self._metrics.observe_switch(event.from_steps, event.to_steps, event.reason, event.time)
            if self._annotator is not None:
                self._annotator.submit(event)
            self._save()
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(None)
            asyncio.get_running_loop().create_task(self._broadcast(*self._loop.mode_tuple))
        done = self._loop.pop_propagated()
        for e in done:
            self._metrics.observe_propagation(e.propagation_s)  # type: ignore[arg-type]
        if done:
            self._save()

    async def _broadcast(self, version: int, num_steps: int, step_policy: str | None) -> None:
        # The long-poll is what guarantees delivery; this direct push is a second path.
        try:
            handle = await self._handle
            await handle.broadcast("apply_num_steps", version, num_steps, step_policy).results_async(
                timeout_s=5.0, return_exceptions=True
            )
        except Exception as e:
            logger.info("direct broadcast of version %d failed (long-poll still delivers): %s", version, e)

    # -- called by replicas -------------------------------------------------------------------

    async def get_num_steps(self) -> tuple[int, int, str | None]:
        """(version, num_steps, engine_step_policy) now."""
        return self._loop.mode_tuple

    async def wait_for_mode(self, known_version: int, timeout_s: float) -> tuple[int, int, str | None]:
        """Long-poll: return (version, num_steps, engine_step_policy) as soon as version >
        known_version, or after timeout_s."""
        if self._loop.version <= known_version:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(fut)
        return self._loop.mode_tuple

    async def report(self, report: ReplicaReport | dict[str, Any]) -> tuple[int, int, str | None]:
        """A replica's load report (a ReplicaReport, or its fields as a dict); answers
        (version, num_steps, engine_step_policy).

        The report's own ``time`` counts, so a report delayed by a controller restart arrives stale."""
        fields = asdict(report) if isinstance(report, ReplicaReport) else report
        fields = {**fields, "time": min(fields.get("time", time.time()), time.time())}
        self._loop.report(ReplicaReport(**fields))
        self._after(None)
        return self._loop.mode_tuple

    async def ack(self, replica_id: str, version: int) -> None:
        self._loop.ack(replica_id, version, time.time())
        self._after(None)

    # -- called by the ingress ----------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        return self._loop.status(time.time())

    async def update(self, mode: str | None, num_steps: int | None, policy: dict | None) -> dict[str, Any]:
        """Operator change; answers the new status, or {"error": ..., "param": ...}."""
        from pydantic import ValidationError

        now = time.time()
        try:
            if policy:
                self._after(self._loop.set_policy(policy, now))
            if mode is not None:
                self._after(self._loop.set_mode(mode, num_steps, now))
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in ("policy", *err["loc"]))
            return {"error": f"{field}: {err['msg']}", "param": field}
        except ValueError as e:
            return {"error": str(e), "param": "mode"}
        self._save()
        return self._loop.status(now)

    async def configure(self, policy: dict, options: dict) -> None:
        """Adopt the application's configured policy and options if they changed (a redeploy
        with new args); run-time policy edits survive otherwise."""
        configured = PolicyConfig.model_validate(policy)
        self._loop.options = ControllerOptions.model_validate(options)
        if configured != self._loop.configured_policy:
            self._loop.configured_policy = self._loop.policy = configured
            self._save()

    async def ping(self) -> bool:
        return True

    async def node_id(self) -> str:
        """The Ray node this controller runs on (hex)."""
        import ray

        return ray.get_runtime_context().get_node_id()


def get_or_create_controller(app_name: str, deployment_name: str, policy: PolicyConfig, options: ControllerOptions):
    """The application's controller actor, created on first call (safe to race)."""
    import ray

    actor_cls = ray.remote(ModeController)
    return actor_cls.options(
        name=controller_name(app_name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=10_000,
        **options.ray_actor_options.actor_options(),
    ).remote(app_name, deployment_name, policy.model_dump(), options.model_dump())


def delete_controller(app_name: str) -> None:
    """Kill an application's controller and forget its saved state (tests, app teardown)."""
    import ray
    from ray.experimental import internal_kv

    try:
        ray.kill(ray.get_actor(controller_name(app_name), namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
    internal_kv._internal_kv_del(_kv_key(app_name))
