"""Tune workflows of a YAML sweep: evaluation prepared once, retries and resumes from checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import pytest
import torch
from ray import tune

from coordinated_prep import eval_loader
from coordinated_prep.trial.loader import resolve_spec
from coordinated_prep.plan import holdout_split
from coordinated_prep.pipeline.sources import open_source
from coordinated_prep.sweep.config import load_sweep
from coordinated_prep.sweep.runner import run_sweep
from tests.conftest import live_coordprep_actors, plasma_objects, plasma_objects_settled
from tests.harness import check_trial_records
from tests.recording import Interrupt, load_records
from trainables import small_cnn
from trainables.common import TuneSession, evaluate, fit

pytestmark = pytest.mark.usefixtures("warm_pool")  # the sweeps below keep their pool warm for the next


def _sweep(tmp_path, small_dataset: str, name: str, extra: str = "", trainable: str = "small_cnn",
           space: str = "", samples: int = 4, pool: str = "{keep_warm: true}") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        storage_path: {tmp_path / "runs"}
        trainable: {trainable}
        data: {{dataset: {small_dataset}, pipeline: {{size: 24}}, chunk_size: 8}}
        pool: {pool}
        search_space: {{lr: {{loguniform: [0.01, 0.1]}}, batch_size: 16, width: 4, epochs: 3{space}}}
        num_samples: {samples}
        max_concurrent_trials: 4
        resources_per_trial: {{cpu: 0.25}}
    """) + textwrap.dedent(extra))
    return str(path)


def _held_out(dataset: str) -> int:
    return len(holdout_split(len(open_source(dataset)), 0.1)[1])


def _both_ways(config: dict) -> dict:
    """Evaluates one model on the shared held-out split and on one this process prepares."""
    spec = resolve_spec(config)
    private = {**config, "data": dataclasses.replace(spec, coordinated=False)}
    torch.manual_seed(0)
    model = small_cnn.build(len(open_source(spec.dataset).classes), config)
    shared_batches, private_batches = list(eval_loader(config, 7)), list(eval_loader(private, 7))
    same = len(shared_batches) == len(private_batches) and all(
        torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and torch.equal(a.indices, b.indices)
        for a, b in zip(shared_batches, private_batches))
    loss_fn = torch.nn.CrossEntropyLoss()
    shared_acc = evaluate(model, config, torch.device("cpu"), loss_fn)
    private_acc = evaluate(model, private, torch.device("cpu"), loss_fn)
    return {"accuracy": shared_acc[1], "same_bytes": same, "shared": list(shared_acc), "private": list(private_acc),
            "indices": [int(i) for b in shared_batches for i in b.indices]}


def evaluate_both_ways(config: dict) -> None:
    """Reports :func:`_both_ways`: the shared evaluation next to this process's own."""
    tune.report(_both_ways(config))


def _check_both_ways(result: dict, held: int) -> None:
    assert result["same_bytes"] is True
    assert result["shared"] == result["private"]
    assert result["indices"] == sorted(result["indices"]) and len(result["indices"]) == held


def test_streamed_shared_evaluation_equals_each_trials_own(ray_session, small_dataset, tmp_path):
    """With nothing resident, every evaluation streams the split, prepared again. (The resident case,
    the pool's default, is checked on the killed-trial sweep below.)"""
    cfg = load_sweep(_sweep(tmp_path, small_dataset, "evalboth", pool="{keep_warm: true, eval_fraction: 0.0}",
                            trainable="tests.test_sweep_workflows:evaluate_both_ways", samples=1))
    summary = run_sweep(cfg, verbose=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"]
    [evaluation] = summary["evaluation"].values()
    held = _held_out(small_dataset)
    # The trial evaluates shared twice: once for the byte comparison, once in evaluate().
    assert evaluation["evaluations"] == 2 and evaluation["samples_served"] == 2 * held
    assert evaluation["resident_pieces"] == 0 and evaluation["samples_prepared"] == evaluation["samples_served"]
    storage = os.path.join(cfg.storage_path, cfg.name)
    for row in summary["trials"]:
        _check_both_ways(_results(storage, row)[-1], held)


def _results(storage: str, row: dict) -> list[dict]:
    """Every result the trial of ``row`` reported, in order (across a resume too)."""
    [directory] = [d for d in os.listdir(storage) if row["trial"] in d]
    with open(os.path.join(storage, directory, "result.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_an_interrupted_sweep_resumes_with_resume_and_finishes_every_trial(ray_session, small_dataset, tmp_path):
    baseline = plasma_objects()
    # One trial at a time, the next in the same process: one process per run. Interrupted at the second
    # result, the first trial is mid-way (checkpointed at epoch 1 at least: the result that interrupts
    # may not keep its checkpoint) and the second has not started.
    # The recording trainable resumes at its checkpoint's epoch (as the ready ones do, checked on the
    # killed-trial sweep below); its records show every trial's epochs exact across the resume.
    records = tmp_path / "records"
    path = _sweep(tmp_path, small_dataset, "interrupted", "metric: score\n", trainable="tests.recording:record",
                  space=f", checkpoint: true, delay_s: 0.02, out: {records}", samples=2)
    cfg = dataclasses.replace(load_sweep(path), max_concurrent_trials=1, reuse_actors=True)
    first = run_sweep(cfg, verbose=0, callbacks=[Interrupt(after=2, marker=str(tmp_path / "interrupted"))])
    assert first["interrupted"], [t["status"] for t in first["trials"]]
    finished = {t["trial"] for t in first["trials"] if t["status"] == "TERMINATED"}
    assert len(finished) < 2
    resumed = run_sweep(cfg, verbose=0, resume=True)
    assert not resumed["interrupted"] and resumed["resumed"], resumed["trials"]
    assert len(resumed["trials"]) == 2, "the summary covers the whole sweep"
    assert all(t["status"] == "TERMINATED" and t["epochs"] == 3 for t in resumed["trials"]), resumed["trials"]
    storage = os.path.join(cfg.storage_path, cfg.name)
    for row in resumed["trials"]:
        reported = [r["epoch"] for r in _results(storage, row)]
        assert reported.count(1) == 1 and reported[-1] == 3, f"the resume went on from the checkpoint: {reported}"
    epochs_of = load_records(str(records))
    assert set(epochs_of) == {t["trial"] for t in resumed["trials"]}
    for trial, epochs in epochs_of.items():
        check_trial_records(cfg.data, epochs, 16, trial)
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline


def _first_to(marker: str) -> bool:
    """Whether this call created ``marker`` (atomically: of trials racing to it, exactly one did)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class _CrashOnce(TuneSession):
    """Tune's session, but the process of the first trial to report epoch 3 dies (as if killed) there,
    after training it; each report is recorded with the process id that made it."""

    def __init__(self, out: str) -> None:
        self.out = out

    def report(self, metrics: dict, state: dict) -> None:
        if metrics["epoch"] == 3 and _first_to(os.path.join(self.out, "crashed")):
            os._exit(1)  # no cleanup, no exception: what a killed process leaves
        with open(os.path.join(self.out, f"{tune.get_context().get_trial_id()}.jsonl"), "a") as f:
            f.write(json.dumps({"epoch": metrics["epoch"], "pid": os.getpid(), "samples": metrics["samples"]}) + "\n")
        super().report(metrics, state)


def crash_once(config: dict) -> None:
    """The small CNN trainable, one trial killed once mid-sweep (see :class:`_CrashOnce`); each trial then
    evaluates both ways (:func:`_both_ways`) and saves what it found."""
    fit(config, small_cnn.build, _CrashOnce(config["out"]))
    with open(os.path.join(config["out"], f"{tune.get_context().get_trial_id()}-both.json"), "w") as f:
        json.dump(_both_ways(config), f)


def test_a_killed_trial_retried_under_max_failures_resumes_at_its_checkpointed_epoch(ray_session, small_dataset,
                                                                                        tmp_path):
    """Also: the held-out split, resident (the pool's default), is prepared once for the sweep, crash and
    all, and each trial's shared evaluation equals the one it prepares itself."""
    baseline = plasma_objects()
    out = tmp_path / "reports"
    out.mkdir()
    cfg = load_sweep(_sweep(tmp_path, small_dataset, "retried", "max_failures: 1\n", samples=2,
                            trainable="tests.test_sweep_workflows:crash_once", space=f", out: {out}"))
    summary = run_sweep(cfg, verbose=0)
    assert [t["status"] for t in summary["trials"]] == ["TERMINATED"] * 2, summary["trials"]
    per_epoch = summary["trials"][0]["epochs"] and next(iter(summary["groups"].values()))["samples_per_epoch"]
    held = _held_out(small_dataset)
    retried = []
    for row in summary["trials"]:
        reports = [json.loads(line) for line in (out / f"{row['trial']}.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in reports] == [1, 2, 3], "epochs 1 and 2 were not trained again"
        assert reports[0]["pid"] == reports[1]["pid"]
        if reports[2]["pid"] != reports[1]["pid"]:
            retried.append(row["trial"])
        assert all(r["samples"] == per_epoch for r in reports)
        _check_both_ways(json.loads((out / f"{row['trial']}-both.json").read_text()), held)
    assert len(retried) == 1, "the killed trial's epoch 3 ran in its retried process; its sibling's in its own"
    [evaluation] = summary["evaluation"].values()
    assert evaluation["samples"] == held and evaluation["resident_pieces"] == evaluation["pieces"]
    # Every epoch is evaluated before it is reported: the killed trial evaluated epoch 3 twice, before
    # it was killed and again in its retry. Then each trial evaluated shared twice more (_both_ways).
    assert evaluation["evaluations"] == 2 * 3 + 1 + 2 * 2
    assert evaluation["samples_prepared"] == held, "the held-out split is prepared once for the sweep, crash and all"
    assert evaluation["samples_served"] == evaluation["evaluations"] * held
    assert live_coordprep_actors() == [] and plasma_objects_settled(baseline) <= baseline
