"""``python -m node bench jepsen``: seeded fault runs against a local cluster and the checker's
verdict (node/jepsen/run.py)."""

from __future__ import annotations

import argparse

from node.bench.common import require_positive


def main(args: argparse.Namespace) -> int:
    require_positive(runs=args.runs, seconds=args.seconds)
    from node.jepsen.run import main as run  # the client and the harness load only here

    return run(args)
