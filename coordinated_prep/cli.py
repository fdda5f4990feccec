"""The ``coordprep`` command: ``coordprep sweep experiments/default.yaml``."""

from __future__ import annotations

import argparse
import logging
import sys

from coordinated_prep.errors import CoordinatedPrepError


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a configuration or dataset error)."""
    parser = argparse.ArgumentParser(prog="coordprep", description="Coordinated data preparation for Ray Tune sweeps.")
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="run a YAML experiment sweep and print its summary")
    sweep.add_argument("experiment", help="path of the sweep's YAML file, e.g. experiments/default.yaml")
    sweep.add_argument("--dry-run", action="store_true", help="validate the file and stop before Ray starts")
    sweep.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2), help="Tune's progress verbosity")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _sweep(args)
    except CoordinatedPrepError as e:
        sys.stderr.write(f"coordprep: error: {e}\n")
        return 2


def _sweep(args: argparse.Namespace) -> int:
    from coordinated_prep.sweep.config import load_sweep

    cfg = load_sweep(args.experiment)  # every configuration error surfaces here, before Ray starts
    if args.dry_run:
        sys.stdout.write(f"{args.experiment}: valid ({cfg.num_samples} samples of {cfg.trainable})\n")
        return 0
    from coordinated_prep.sweep.runner import run_sweep
    from coordinated_prep.sweep.summary import format_summary

    summary = run_sweep(cfg, verbose=args.verbose)
    sys.stdout.write("\n" + format_summary(summary) + f"\n\nSummary written to {summary['path']}\n")
    return 0 if all(t["status"] != "ERROR" for t in summary["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
