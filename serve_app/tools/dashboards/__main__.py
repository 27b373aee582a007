"""python -m serve_app.tools.dashboards build | publish --url URL [--token TOKEN] [--folder UID]"""

from __future__ import annotations

import argparse
import os
import sys

from serve_app.tools.dashboards import DASHBOARDS_DIR, build_all, write_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.tools.dashboards", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help=f"write the dashboard JSON into {DASHBOARDS_DIR}")
    build.add_argument("--out", default=str(DASHBOARDS_DIR))
    pub = sub.add_parser("publish", help="upsert the dashboards into Grafana by uid")
    pub.add_argument("--url", required=True, help="Grafana base URL, e.g. http://localhost:3000")
    pub.add_argument(
        "--token", default=os.environ.get("GRAFANA_TOKEN"), help="service account token (env GRAFANA_TOKEN)"
    )
    pub.add_argument("--folder", default="specserve", help="folder uid (created if missing)")
    args = parser.parse_args(argv)

    if args.command == "build":
        from pathlib import Path

        for path in write_all(Path(args.out)):
            print(path)
        return 0
    from serve_app.tools.dashboards.publish import publish

    for uid, result in publish(args.url, args.token, build_all(), args.folder).items():
        print(f"{uid}: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
