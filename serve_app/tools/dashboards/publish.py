"""Upsert the dashboards into Grafana by uid, in one folder, with grafana-client.

Idempotent: a dashboard whose stored JSON already equals ours is left alone (no new
version); otherwise it is written with ``overwrite`` so that the uid, not the title, decides.
"""

from __future__ import annotations

from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

FOLDER_UID = "specserve"
FOLDER_TITLE = "specserve"
_SERVER_KEYS = ("id", "version")  # Grafana adds these to what it stores


def ensure_folder(api: GrafanaApi, uid: str = FOLDER_UID, title: str = FOLDER_TITLE) -> str:
    """The folder's uid, creating the folder if it is missing."""
    try:
        return api.folder.get_folder(uid)["uid"]
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
    return api.folder.create_folder(title, uid=uid)["uid"]


def _stored(api: GrafanaApi, uid: str) -> dict[str, Any] | None:
    try:
        return api.dashboard.get_dashboard(uid)
    except GrafanaClientError as e:
        if e.status_code == 404:
            return None
        raise


def upsert(api: GrafanaApi, dashboard: dict[str, Any], folder_uid: str) -> str:
    """Write one dashboard; answers "created", "updated" or "unchanged"."""
    stored = _stored(api, dashboard["uid"])
    if stored is not None:
        current = {k: v for k, v in stored["dashboard"].items() if k not in _SERVER_KEYS}
        if current == dashboard and stored.get("meta", {}).get("folderUid") == folder_uid:
            return "unchanged"
    body = {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid, "overwrite": True}
    api.dashboard.update_dashboard({**body, "message": "specserve: python -m serve_app.tools.dashboards publish"})
    return "created" if stored is None else "updated"


def publish(url: str, token: str | None, dashboards: dict[str, dict[str, Any]], folder_uid: str = FOLDER_UID):
    """Upsert every dashboard into the folder; answers {uid: result}."""
    api = GrafanaApi.from_url(url, credential=token)
    folder = ensure_folder(api, folder_uid)
    return {d["uid"]: upsert(api, d, folder) for d in dashboards.values()}
