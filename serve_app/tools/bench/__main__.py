"""``python -m serve_app.tools.bench <command>``: one subcommand per module.

A subcommand module has a docstring, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; adding one is an import and an entry in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from . import acceptance, agreement, efficiency, engine, faults, memory, ops, report, serve, steps, trace

COMMANDS = {"engine": engine, "steps": steps, "serve": serve, "trace": trace, "report": report, "faults": faults,
            "memory": memory, "ops": ops, "agreement": agreement,
            "efficiency": efficiency, "acceptance": acceptance}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.tools.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
