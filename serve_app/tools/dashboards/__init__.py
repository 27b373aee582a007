"""specserve's Grafana dashboards, as code.

``python -m serve_app.tools.dashboards build`` writes ``dashboards/*.json``;
``python -m serve_app.tools.dashboards publish --url URL --token TOKEN`` upserts them into Grafana.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.tools.dashboards import control_plane, overview
from serve_app.tools.dashboards.common import to_json

DASHBOARDS_DIR = Path(__file__).resolve().parents[3] / "dashboards"
BUILDERS = {"overview.json": overview.build, "control_plane.json": control_plane.build}


def build_all() -> dict[str, dict[str, Any]]:
    """File name → dashboard JSON, for every dashboard."""
    return {name: to_json(build()) for name, build in BUILDERS.items()}


def render(dashboard: dict[str, Any]) -> str:
    """The committed text of a dashboard: stable key order, one trailing newline."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def write_all(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, dashboard in build_all().items():
        path = directory / name
        path.write_text(render(dashboard))
        paths.append(path)
    return paths
