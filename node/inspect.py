"""Benchmarks (placeholder until filled in)."""

import argparse


def main(args: argparse.Namespace) -> int:
    raise SystemExit("bench: not written yet")
