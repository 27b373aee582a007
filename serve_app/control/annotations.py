"""Optional HTTP annotations on each switch, posted to Grafana from the controller.

The controller only ever calls :meth:`GrafanaAnnotator.submit`, which never waits: a switch
goes into a bounded queue (dropped and counted when full), and one background task posts it
with grafana-client in a thread, with a timeout. Failures are counted and logged, nothing
more. The Prometheus annotation query in the dashboards needs none of this.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


class GrafanaAnnotator:
    """Posts ``{time, tags, text}`` for each switch to every configured dashboard."""

    def __init__(self, app: str, config, metrics):
        self._app, self._config, self._metrics = app, config, metrics
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=config.queue_size)
        self._api = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, event) -> None:
        """Queue a switch event (see controller.SwitchEvent); never blocks."""
        note = {
            "time_ms": int(event.time * 1000),
            "tags": ["specserve", f"app:{self._app}", f"reason:{event.reason}"],
            "text": f"switch {event.from_steps} → {event.to_steps} steps: {event.reason}"
            + (f" ({event.detail})" if event.detail else ""),
        }
        try:
            self._queue.put_nowait(note)
        except asyncio.QueueFull:
            self._metrics.observe_annotation("dropped")
            logger.warning("grafana annotation queue full: dropped %s", note["text"])

    def _post(self, note: dict[str, Any]) -> None:
        if self._api is None:
            from grafana_client import GrafanaApi

            token = os.environ.get(self._config.token_env)
            self._api = GrafanaApi.from_url(self._config.url, credential=token, timeout=self._config.timeout_s)
        for uid in self._config.dashboard_uids:
            self._api.annotations.add_annotation(
                dashboard_uid=uid, time_from=note["time_ms"], tags=note["tags"], text=note["text"]
            )

    async def _run(self) -> None:
        while True:
            note = await self._queue.get()
            try:
                await asyncio.wait_for(asyncio.to_thread(self._post, note), 2 * self._config.timeout_s)
                self._metrics.observe_annotation("sent")
            except Exception as e:  # a Grafana outage must never reach the controller
                self._metrics.observe_annotation("failed")
                logger.warning("grafana annotation failed (%s): %s", note["text"], e)
