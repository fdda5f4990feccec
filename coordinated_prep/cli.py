"""``coordprep``: ``sweep|analyze|memory|bench|echo <experiment.yaml>``, ``best <sweep dir>``, ``dashboard``,
``convert``, ``clean``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TextIO

from coordinated_prep.errors import ConfigError, CoordinatedPrepError


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for a configuration or dataset error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    commands = {"sweep": _sweep, "analyze": _analyze, "memory": _memory, "bench": _bench, "echo": _echo,
                "dashboard": _dashboard, "convert": _convert, "clean": _clean, "best": _best}
    try:
        return commands[args.command](args)
    except CoordinatedPrepError as e:
        sys.stderr.write(f"coordprep: error: {e}\n")
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``coordprep`` argument parser (the docs' commands are checked against it)."""
    parser = argparse.ArgumentParser(prog="coordprep", description="Coordinated data preparation for Ray Tune sweeps.")
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="run a YAML experiment sweep and print its summary")
    sweep.add_argument("experiment", help="path of the sweep's YAML file, e.g. experiments/default.yaml")
    sweep.add_argument("--dry-run", action="store_true", help="validate the file, build every data spec's factories and prepare their first samples, "
                            "then stop before Ray starts")
    sweep.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2), help="Tune's progress verbosity")
    sweep.add_argument("--quiet", action="store_true",
                       help="no progress line (each data group's sharing factor and stall fraction every 5 s)")
    sweep.add_argument("--resume", action="store_true",
                       help="resume the interrupted sweep saved under <storage_path>/<name>: unfinished and errored "
                            "trials go on from their last checkpoints")
    analyze = sub.add_parser("analyze", help="measure the experiment's input pipeline: stalls and what-if predictions")
    analyze.add_argument("experiment", help="path of the sweep's YAML file")
    analyze.add_argument("--out", help="directory for analysis.json and analysis.png "
                                      "(default: <storage_path>/<name>/analysis)")
    analyze.add_argument("--samples", type=int, default=512, help="training samples to measure (default 512)")
    analyze.add_argument("--cores", type=int, help="CPU cores for preparation (default: this machine's)")
    analyze.add_argument("--step-ms", type=float, help="time a simulated accelerator step of this many ms per "
                                                       "batch instead of the trainable's model")
    analyze.add_argument("--disk-probe-dir", metavar="DIR",
                         help="measure the disk with a 128 MiB scratch file written (and removed) in DIR, a "
                              "directory outside the dataset on its filesystem; by default the dataset's own "
                              "largest files are read, and nothing is written")
    analyze.add_argument("--trials", default="1,4,8",
                         help="concurrent trial counts of the measured coordinated runs (default 1,4,8); the "
                              "fewest trials' CPU per batch is the model's trial-side cost")
    analyze.add_argument("--run-samples", type=int, default=8192,
                         help="samples each trial of the measured coordinated runs reads, in whole epochs up to "
                              "this (default 8192)")
    analyze.add_argument("--no-coordinated-runs", action="store_true",
                         help="skip the measured coordinated runs (Ray and Tune; tens of seconds): quicker, but "
                              "the model then has no trial-side cost")
    memory = sub.add_parser("memory", help="measure one training step per (model, batch size, crop, memory mode) of "
                                           "the sweep: activation, parameter, gradient, optimizer and peak memory, "
                                           "and step time")
    memory.add_argument("experiment", help="path of the sweep's YAML file, e.g. experiments/memory.yaml")
    memory.add_argument("--out", help="directory for memory.json and memory.png (default: <storage_path>/<name>/memory)")
    memory.add_argument("--steps", type=int, default=3, help="timed steps per configuration (default 3)")
    memory.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    memory.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, usually the cores)")
    bench = sub.add_parser("bench", help="benchmark coordinated prep against a DataLoader and DALI per trial, "
                                         "and raw image files against Parquet record files")
    bench.add_argument("experiment", nargs="?", default="experiments/bench.yaml",
                       help="the benchmark's YAML file (default experiments/bench.yaml)")
    bench.add_argument("--trials", help="comma-separated concurrent trial counts, overriding the file (e.g. 1,4)")
    bench.add_argument("--out", help="directory for bench.csv and bench.png (default <storage_path>/<name>)")
    echo = sub.add_parser("echo", help="compare data-echoing variants on one sweep: time and fresh samples to "
                                       "echo-off's final accuracy, final accuracy, stalls; writes echo.csv/json/png")
    echo.add_argument("experiment", nargs="?", default="experiments/echo.yaml",
                      help="the echo experiment's YAML file (default experiments/echo.yaml)")
    echo.add_argument("--variants", help="comma-separated variant names to run (default all; off is always run)")
    echo.add_argument("--out", help="directory for echo.csv, echo.json and echo.png (default <storage_path>/<name>)")
    echo.add_argument("--dry-run", action="store_true", help="validate the file and every variant's sweep, then stop")
    convert = sub.add_parser("convert", help="write a dataset as Parquet record files or WebDataset tar shards")
    convert.add_argument("imagefolder", help="the dataset: an ImageFolder directory, tar shards (a folder of *.tar or "
                                             "a pattern such as 'shards-{0000..0063}.tar'), a Parquet dataset, or "
                                             "builtin:shapes / builtin:shapes-large")
    convert.add_argument("out", help="the output directory (created; must be empty unless --overwrite)")
    convert.add_argument("--shard-size", type=int, help="samples per shard file (default 1024)")
    convert.add_argument("--row-group-size", type=int,
                         help="samples per row group, the unit one random read fetches (default 16)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a dataset converted into OUT before (only its own files are removed)")
    convert.add_argument("--format", choices=("parquet", "tar"), default="parquet",
                         help="parquet: record files with a manifest (default); tar: WebDataset shards "
                              "(shard-NNNNNN.tar, <index>.<ext> and <index>.cls per sample)")
    dashboard = sub.add_parser("dashboard", help="install the Grafana dashboard of the coordprep_* metrics where the "
                                                 "running Ray cluster's Grafana loads it, or write it to --out")
    dashboard.add_argument("--out", help="write the dashboard JSON to this file (or into this directory) instead")
    dashboard.add_argument("--address", default="auto", help="the Ray cluster to install into (default: auto)")
    best = sub.add_parser("best", help="print a finished sweep's best trial (or --trial): its config, its DataSpec and "
                                       "how to train it again with the standalone loader; and the sweep's data groups")
    best.add_argument("path", help="the sweep's directory, <storage_path>/<name> (e.g. runs/default)")
    best.add_argument("--trial", help="this trial id instead of the best")
    best.add_argument("--metric", help="rank by this reported metric (default: the sweep's)")
    best.add_argument("--mode", choices=("min", "max"), help="with --metric: lower or higher is better")
    best.add_argument("--json", action="store_true", help="print trial, config, data and metrics as JSON")
    sub.add_parser("clean", help="delete the node-cache memory (arena files in /dev/shm and the temporary "
                                 "directory) that killed or crashed sweeps left on this machine")
    for command in (analyze, memory, bench):
        command.add_argument("--dry-run", action="store_true", help="validate the file and stop before anything runs")
    return parser


def _sweep(args: argparse.Namespace) -> int:
    from coordinated_prep.sweep.config import load_sweep

    cfg = load_sweep(args.experiment)  # every configuration error surfaces here, before Ray starts
    if args.dry_run:
        from coordinated_prep.sweep.preflight import preflight

        specs = preflight(cfg)  # every factory built, every data group's first samples prepared
        sys.stdout.write(f"{args.experiment}: valid ({cfg.num_samples} samples of {cfg.trainable}; {specs} data "
                         f"spec{'s' if specs != 1 else ''} built and checked)\n")
        if cfg.gpu_auto is not None:
            sys.stdout.write(_gpu_auto_note() + "\n")
        return 0
    from coordinated_prep.sweep.runner import run_sweep
    from coordinated_prep.sweep.summary import format_summary

    summary = run_sweep(cfg, verbose=args.verbose, resume=args.resume, progress=None if args.quiet else sys.stdout)
    sys.stdout.write("\n" + format_summary(summary) + f"\n\nSummary written to {summary['path']}\n")
    if summary.get("interrupted"):
        sys.stdout.write(f"The sweep was interrupted; resume it with: coordprep sweep {args.experiment} --resume\n")
        return 1
    return exit_status(summary)


def exit_status(summary: dict) -> int:
    """A finished sweep's exit status: 0 when no trial failed; 2 when a trial failed on its configuration
    or data (a factory's arguments, a broken sample: the status of the same error before Ray starts);
    1 for any other trial error."""
    kinds = {t.get("error_kind") or "other" for t in summary["trials"] if t["status"] == "ERROR"}
    return 2 if "config" in kinds else 1 if kinds else 0


def _best(args: argparse.Namespace) -> int:
    import json

    from coordinated_prep.tune.results import best_trial, saved_reports

    best = best_trial(args.path, args.trial, args.metric, args.mode)
    if args.json:
        sys.stdout.write(json.dumps({"trial": best.trial, "config": best.config, "data": repr(best.data),
                                     "metrics": best.metrics, "path": best.path}, indent=1, default=str) + "\n")
        return 0
    which = f"Trial {best.trial}" if args.trial else "Best trial"
    from coordinated_prep.tune.results import ranked_by

    shown = ("accuracy", "loss", args.metric, ranked_by(args.path))  # and the metric the sweep ranks by
    scores = ", ".join(f"{k}={v}" for k, v in best.metrics.items() if k in shown)
    # the call that finds this very trial: the flags given, as its arguments
    call = ", ".join([repr(args.path)] + [f"{k}={v!r}" for k, v in (("trial", args.trial), ("metric", args.metric),
                                                                     ("mode", args.mode)) if v is not None])
    lines = [f"{which}: {best.trial}  {scores}", f"config: {best.config}", f"data: {best.data!r}", "",
             "Train it again without Tune (the loader prepares the data in its own process):",
             "  from coordinated_prep import best_trial, train_loader",
             f"  best = best_trial({call})",
             "  loader = train_loader(best.data, batch_size=best.config['batch_size'])"]
    groups = saved_reports(args.path).get("groups") or {}
    if groups:
        from coordinated_prep.sweep.summary import format_table

        lines += ["", format_table(["group", "prepared", "served", "saving"], [
            [key, g.get("samples_prepared"), g.get("samples_served"),
             f"{g['samples_served'] / g['samples_prepared']:.2f}x" if g.get("samples_prepared") else "-"]
            for key, g in groups.items()])]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from coordinated_prep.dashboard import install, write

    path = write(args.out) if args.out else install(args.address)
    sys.stdout.write(f"Grafana dashboard written to {path}\n")
    if not args.out:
        sys.stdout.write("Grafana started with the cluster's grafana.ini loads it (Dashboards > coordinated_prep); "
                         "the Ray dashboard's Metrics tab links to that Grafana when RAY_GRAFANA_HOST is set\n")
    return 0


def _echo(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from coordinated_prep.bench.echo import BASELINE, format_echo, load_echo, run_echo

    experiment = load_echo(args.experiment)
    if args.variants:
        wanted = {BASELINE, *(v.strip() for v in args.variants.split(","))}
        unknown = sorted(wanted - {v.name for v in experiment.variants})
        if unknown:
            raise ConfigError(f"echo: --variants names {unknown}, not in {[v.name for v in experiment.variants]}")
        experiment = dataclasses.replace(experiment, variants=tuple(v for v in experiment.variants if v.name in wanted))
    if args.dry_run:
        sys.stdout.write(f"{args.experiment}: valid ({len(experiment.variants)} variants: "
                         f"{', '.join(v.name for v in experiment.variants)})\n")
        return 0
    sweep = experiment.sweep
    out = args.out or os.path.join(sweep.get("storage_path", "runs"), sweep.get("name", "echo"))
    result = run_echo(experiment, out)
    sys.stdout.write("\n" + format_echo(result) + f"\n\nWritten to {out} (echo.csv, echo.json, echo.png)\n")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    import os

    from coordinated_prep.analyze.coordinated import parse_trials
    from coordinated_prep.analyze.report import format_report, write_report
    from coordinated_prep.analyze.run import analyze
    from coordinated_prep.sweep.config import load_sweep

    cfg = load_sweep(args.experiment)
    if args.cores is not None and args.cores < 1:
        raise ConfigError(f"analyze: --cores={args.cores} must be at least 1")
    trials = () if args.no_coordinated_runs else parse_trials(args.trials)  # its flags checked before a dry run too
    if args.dry_run:
        return _valid(args.experiment)
    report = analyze(cfg, samples=args.samples, cores=args.cores, step_ms=args.step_ms,
                     disk_probe_dir=args.disk_probe_dir, trials=trials, run_samples=args.run_samples)
    out = args.out or os.path.join(cfg.storage_path, cfg.name, "analysis")
    paths = write_report(report, out)
    sys.stdout.write(format_report(report) + f"\n\nWritten: {paths['json']} and {paths['png']}\n")
    return 0


def _valid(path: str) -> int:
    sys.stdout.write(f"{path}: valid\n")
    return 0


def _gpu_auto_note() -> str:
    from coordinated_prep.memory_tool.auto import NO_GPU, gpu_bytes

    gpu = gpu_bytes()
    if gpu is None:
        return f"note: {NO_GPU}"
    return (f"gpu: auto: each configuration's peak is measured on this GPU ({gpu / 2**30:.1f} GiB) when the sweep "
            "starts; coordprep memory shows the peaks now")


def _memory(args: argparse.Namespace) -> int:
    import os

    from coordinated_prep.memory_tool.report import format_report, write_report
    from coordinated_prep.memory_tool.run import run_memory
    from coordinated_prep.sweep.config import load_sweep

    cfg = load_sweep(args.experiment)
    for flag, value, low in (("steps", args.steps, 1), ("warmup", args.warmup, 0), ("threads", args.threads, 1)):
        if value is not None and value < low:  # checked before a dry run too
            raise ConfigError(f"memory: --{flag}={value} must be >= {low}")
    if args.dry_run:
        return _valid(args.experiment)
    report = run_memory(cfg, steps=args.steps, warmup=args.warmup, threads=args.threads)
    out = args.out or os.path.join(cfg.storage_path, cfg.name, "memory")
    paths = write_report(report, out)
    sys.stdout.write(format_report(report) + f"\n\nWritten: {paths['json']} and {paths['png']}\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import platform

    from coordinated_prep.bench.config import load_bench
    from coordinated_prep.bench.report import format_rows, write_outputs
    from coordinated_prep.bench.run import run_bench

    cfg = load_bench(args.experiment)
    if args.trials:
        try:
            cfg = dataclasses.replace(cfg, trials=tuple(int(n) for n in args.trials.split(",")))
        except ValueError:
            raise ConfigError(f"bench: --trials={args.trials!r} must be comma-separated integers, e.g. 1,2,4,8") from None
    if args.dry_run:
        return _valid(args.experiment)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's per-run banner would bury the table
    machine = f"{platform.node()}: {cfg.cores} cores, {platform.processor() or platform.machine()}"

    def progress(row: dict) -> None:
        sys.stdout.write(format_rows([row]).splitlines()[-1] + "\n")
        sys.stdout.flush()

    rows = run_bench(cfg, progress)
    out = args.out or os.path.join(cfg.storage_path, cfg.name)
    pipeline = f"{cfg.size} px crops" if cfg.transform is None else f"transform {cfg.transform.factory}"
    paths = write_outputs(rows, out, f"coordprep bench ({machine}; batch {cfg.batch_size}, {pipeline})")
    sys.stdout.write("\n" + format_rows(rows) + f"\n\nMachine: {machine}\nWritten: {paths['csv']} and {paths['png']}\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from coordinated_prep.convert import convert_imagefolder

    sizes = {name: value for name, value in (("shard_size", args.shard_size), ("row_group_size", args.row_group_size))
             if value is not None}  # unset: the converter's defaults
    bar = _ProgressBar(sys.stderr, "converting")
    try:
        if args.format == "tar":
            from coordinated_prep.convert import convert_to_tar

            if args.row_group_size is not None:
                raise ConfigError("convert: --row-group-size is a Parquet option; tar shards have no row groups")
            result = convert_to_tar(args.imagefolder, args.out, overwrite=args.overwrite, progress=bar.update, **sizes)
        else:
            result = convert_imagefolder(args.imagefolder, args.out, overwrite=args.overwrite, progress=bar.update,
                                         **sizes)
    finally:
        bar.close()
    sys.stdout.write(f"{result.out}: {len(result.shards)} shards, {result.samples} samples, "
                     f"{result.file_bytes / 2**20:.1f} MiB ({result.image_bytes / 2**20:.1f} MiB of images), "
                     f"{result.seconds:.1f} s\n")
    return 0


def _clean(args: argparse.Namespace) -> int:
    from coordinated_prep.cache.arena import arena_dirs, remove_stale

    removed = remove_stale()  # only arenas whose owner is gone: a live sweep's are left alone
    for path, size in removed.items():
        sys.stdout.write(f"removed {path} ({size / 2**20:.1f} MiB)\n")
    sys.stdout.write(f"{len(removed)} arena file(s) removed, {sum(removed.values()) / 2**20:.1f} MiB freed, in "
                     f"{' and '.join(arena_dirs())}; arenas of running sweeps were left alone\n")
    return 0


class _ProgressBar:
    """A one-line text progress bar, redrawn with carriage returns at most ten times a second.

    The line ends when the work is complete (or on ``close``), so that log lines start on their own.
    """

    def __init__(self, stream: TextIO, label: str, width: int = 30, interval_s: float = 0.1) -> None:
        self._stream, self._label, self._width, self._interval = stream, label, width, interval_s
        self._last = float("-inf")
        self._drawn = False
        self._start: tuple[float, int] | None = None  # (time, done) of the first update: the rate's origin

    def update(self, done: int, total: int) -> None:
        """Record progress; redraws only when ``interval_s`` has passed or the work is complete."""
        now = time.perf_counter()
        if self._start is None:
            self._start = (now, done)
        if now - self._last < self._interval and done < total:
            return
        self._last = now
        filled = self._width * done // max(total, 1)
        rate = (done - self._start[1]) / max(now - self._start[0], 1e-9)
        self._stream.write(f"\r{self._label} [{'#' * filled}{'.' * (self._width - filled)}] "
                           f"{done}/{total} ({rate:.0f}/s)")
        self._drawn = done < total
        if not self._drawn:
            self._stream.write("\n")
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line (if it drew anything), so later output starts on a fresh line."""
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False


if __name__ == "__main__":
    sys.exit(main())
