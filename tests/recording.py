"""A Tune trainable that records what each trial saw, for the exactly-once and identity checks."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import numpy as np
import ray
from ray import tune

from coordinated_prep import eval_loader, train_loader
from tests.harness import batch_digests, sample_digests


def pids_titled(prefix: str) -> list[int]:
    """Processes whose title (Ray names its workers ``ray::<Actor>...``) starts with ``prefix``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(prefix):
            pids.append(int(pid))
    return pids


def warm_prep_processes() -> list[int]:
    """Prep actor processes that have loaded torch's library (imported what they need to prepare)."""
    warm = []
    for pid in pids_titled("ray::PrepActor"):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if "libtorch_cpu" in f.read():
                    warm.append(pid)
        except OSError:
            continue
    return warm


def _inject(config: dict, epoch: int, step: int) -> None:
    """Fault injection at a deterministic point: after ``fault_step`` batches of epoch 0."""
    fault = config.get("fault")
    if not fault or epoch != 0 or step != config.get("fault_step", 2):
        return
    if fault == "kill_self":
        marker = os.path.join(config["out"], "killed-once")
        if not os.path.exists(marker):  # only the first attempt dies; Tune's retry goes on
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a function trainable runs in its trial's worker process
    elif fault in ("kill_prep", "kill_coordinator"):
        marker = os.path.join(config["out"], f"{fault}-done")
        if os.path.exists(marker):  # once per test: a retried trial must not kill again
            return
        open(marker, "w").close()
        cls = "PrepActor" if fault == "kill_prep" else "Coordinator"
        # By process title (the tests' Ray runs no dashboard, so no state API); one Ray runs the tests.
        victims = pids_titled(f"ray::{cls}")
        assert victims, f"no live {cls} actor"
        os.kill(victims[0], signal.SIGKILL)


class OpenOnResult(tune.Callback):
    """Opens the :class:`Gate` ``gate`` once Tune has a result with ``epoch >= epoch``."""

    def __init__(self, gate: str, epoch: int) -> None:
        self.gate, self.epoch = gate, epoch

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("epoch", 0) >= self.epoch:
            ray.get(ray.get_actor(self.gate, namespace="coordinated_prep").open.remote(), timeout=60)


class Interrupt(tune.Callback):
    """Interrupts the sweep as Ctrl-C would (SIGINT to the driver) once ``after`` results came in.

    Once per ``marker`` file: Tune restores the callback with the run, and the resumed run goes on.
    """

    def __init__(self, after: int, marker: str) -> None:
        self.after, self.seen, self.marker = after, 0, marker

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.seen += 1
        if self.seen >= self.after and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGINT)  # Tune's handler stops the loop and saves the state


@ray.remote(num_cpus=0)
class Gate:
    """Where trials wait for the test: each ``arrive`` and then waits until the test ``open`` s it."""

    def __init__(self) -> None:
        self.arrived: set[str] = set()
        self.changed = asyncio.Condition()
        self.is_open = False

    async def arrive(self, trial: str) -> None:
        async with self.changed:
            self.arrived.add(trial)
            self.changed.notify_all()

    async def wait_arrivals(self, n: int, timeout_s: float) -> int:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.arrived) >= n), timeout_s)
        return len(self.arrived)

    async def wait_open(self, timeout_s: float) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.is_open), timeout_s)

    async def opened(self) -> bool:
        return self.is_open

    async def open(self) -> None:
        async with self.changed:
            self.is_open = True
            self.changed.notify_all()


def record(config: dict) -> None:
    """Iterate ``epochs`` epochs; save per epoch: indices, stream epochs, digests, batch sizes, node.

    Optional: ``delay_s`` per batch (a slow trial's compute step; with ``delay_while_shared``, only
    until the loader has prepared a sample itself: a straggler detached from its group; with
    ``delay_until``, a file name, only until that file exists in ``out``: slow until a fault was
    injected, so that the retries run at full speed), ``fault`` to inject (see _inject),
    ``write`` (True: write into every leaf of every batch in place, after recording it),
    ``declare_epochs`` (True: the loader is told the epochs, so nothing past them is prepared),
    ``checkpoint`` (True: a checkpoint holding the epoch is reported every epoch, and a restored
    trial resumes at that epoch, declaring the epochs left),
    ``gate`` (name of a :class:`Gate` in the coordinated_prep namespace: after epoch ``gate_after``
    the trial arrives there and waits for the test to open it), ``eval_s`` (seconds of a simulated
    evaluation after each epoch), ``evaluate`` (True: read the held-out split with ``eval_loader``
    after each epoch), ``echo`` (the loader's echo setting), ``until_open`` (name of a :class:`Gate`:
    the trial stops after the first epoch that began with it open, or after ``epochs``). Each epoch
    also records the prep processes alive on the machine.
    """
    out = os.path.join(config["out"], tune.get_context().get_trial_id())
    os.makedirs(out, exist_ok=True)
    warm_at_start = len(warm_prep_processes())  # before this trial asks its group for anything
    first = _restored_epoch()  # 0 unless Tune restored the trial from its checkpoint (pause, PBT, retry)
    if first >= config["epochs"]:
        return  # restored from a checkpoint of its last epoch (a PBT exploit of a finished trial)
    loader = train_loader(config, batch_size=config["batch_size"],
                          epochs=config["epochs"] - first if config.get("declare_epochs", True) else None,
                          echo=config.get("echo"))
    until = ray.get_actor(config["until_open"], namespace="coordinated_prep") if config.get("until_open") else None
    for epoch in range(first, config["epochs"]):
        last = until is not None and ray.get(until.opened.remote(), timeout=60)
        parts = []
        for step, b in enumerate(loader):
            parts.append((b.indices.numpy(), b.stream_epochs.numpy(), sample_digests(b.images.numpy()), len(b)))
            if config.get("write"):  # in place into every leaf, as a loop that normalises or mixes does
                b.images.sub_(1)
                b.labels[b.labels >= 0] = -1
            _inject(config, epoch, step)
            if config.get("delay_s") and not (config.get("delay_while_shared") and loader.private_samples) and not (
                    config.get("delay_until") and os.path.exists(os.path.join(config["out"], config["delay_until"]))):
                time.sleep(config["delay_s"])  # stands for a slow compute step, not for synchronisation
        np.savez(os.path.join(out, f"epoch{epoch}.npz"),
                 indices=np.concatenate([p[0] for p in parts]), stream_epochs=np.concatenate([p[1] for p in parts]),
                 digests=np.concatenate([p[2] for p in parts]), batch_sizes=np.array([p[3] for p in parts]),
                 start=loader.start_piece, coordinator=str(loader.coordinator),
                 private_samples=loader.private_samples, node=ray.get_runtime_context().get_node_id(),
                 prep_processes=len(pids_titled("ray::PrepActor")), warm_at_start=warm_at_start)
        metrics = {"epoch": epoch + 1, "score": float(config.get("score", 0.0)) * (epoch + 1)}
        if config.get("evaluate"):  # one pass over the held-out split, as the ready trainables make
            metrics["eval_samples"] = sum(len(b) for b in eval_loader(config, 16))
        if config.get("checkpoint"):
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "epoch"), "w") as f:
                    f.write(str(epoch + 1))
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
        else:
            tune.report(metrics)
        if config.get("eval_s"):
            time.sleep(config["eval_s"])  # stands for a long evaluation, not for synchronisation
        if config.get("gate") and epoch == config.get("gate_after", 0):
            gate = ray.get_actor(config["gate"], namespace="coordinated_prep")
            ray.get(gate.arrive.remote(tune.get_context().get_trial_id()), timeout=60)
            ray.get(gate.wait_open.remote(300), timeout=330)
        if last:
            break


def record_digests(config: dict) -> None:
    """Per epoch (``config["epochs"]``, batches of 16): indices, stream epochs and a digest of every
    sample, in ``<out>/<trial id>/epoch<k>.npz``."""
    out = os.path.join(config["out"], tune.get_context().get_trial_id())
    os.makedirs(out, exist_ok=True)
    loader = train_loader(config, batch_size=16, epochs=config["epochs"])
    for epoch in range(config["epochs"]):
        parts = [(b.indices.numpy(), b.stream_epochs.numpy(), batch_digests(b)) for b in loader]
        np.savez(os.path.join(out, f"epoch{epoch}.npz"), *[np.concatenate(p) for p in zip(*parts)])
        tune.report({"epoch": epoch + 1})


def _restored_epoch() -> int:
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as d, open(os.path.join(d, "epoch")) as f:
        return int(f.read())


def load_records(out: str, contiguous: bool = True) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per trial id: the saved epochs in order (with ``contiguous``, none may be missing)."""
    records = {}
    for trial in sorted(os.listdir(out)):
        if not os.path.isdir(os.path.join(out, trial)):
            continue
        files = sorted(f for f in os.listdir(os.path.join(out, trial)) if f.endswith(".npz"))
        files.sort(key=lambda f: int(f[5:-4]))
        records[trial] = [dict(np.load(os.path.join(out, trial, f))) for f in files]
        if contiguous:
            assert [int(f[5:-4]) for f in files] == list(range(len(files))), f"{trial}: epochs missing: {files}"
    return records


def record_ranks(config: dict) -> None:
    """A Tune trial of ``config["workers"]`` Ray Train workers (Train V2), each running :func:`record_rank`.

    Optional: ``max_failures`` (Ray Train restarts the worker group that often; default 0),
    ``cpu_per_worker`` (0.2), ``placement`` (the workers' placement strategy, ``PACK``). The trial id reaches the workers with the DataSpec (nothing passed by hand).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trial = tune.get_context().get_trial_id()
    trainer = TorchTrainer(
        record_rank, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=config["workers"], use_gpu=False,
                                     resources_per_worker={"CPU": config.get("cpu_per_worker", 0.2)},
                                     placement_strategy=config.get("placement", "PACK")),
        run_config=RunConfig(name=f"ranks-{trial}", storage_path=os.path.join(config["out"], "train-storage"),
                             failure_config=FailureConfig(max_failures=config.get("max_failures", 0)),
                             callbacks=[TuneReportCallback()]))
    trainer.fit()


def record_rank(config: dict) -> None:
    """One Ray Train worker: iterate ``epochs`` epochs (resuming after the checkpoint's) and save per
    rank and epoch the indices, repeats, stream epochs, digests and batch sizes; rank 0 reports a
    checkpoint of the epoch. ``fault: "kill_rank"`` kills rank 1 once, after ``fault_step`` batches
    of epoch ``fault_epoch`` (1), once the :class:`Gate` named ``gate`` opens (:class:`OpenOnResult`:
    Tune has the result of the epoch before, so Ray Train has registered its checkpoint)."""
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    first = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "epoch")) as f:
            first = int(f.read())
    loader = train_loader(config, batch_size=config["batch_size"], epochs=config["epochs"] - first,
                          drop_last=config.get("drop_last", False))
    out = os.path.join(config["out"], loader.trial, f"rank{rank}")
    os.makedirs(out, exist_ok=True)
    until = ray.get_actor(config["until_open"], namespace="coordinated_prep") if config.get("until_open") else None
    for epoch in range(first, config["epochs"]):
        last = until is not None and ray.get(until.opened.remote(), timeout=60)
        parts = []
        for step, b in enumerate(loader):
            parts.append((b.indices.numpy(), b.repeats.numpy(), b.stream_epochs.numpy(),
                          sample_digests(b.images.numpy()), len(b)))
            if (config.get("fault") == "kill_rank" and rank == 1 and epoch == config.get("fault_epoch", 1)
                    and step == config.get("fault_step", 2)):
                marker = os.path.join(config["out"], "killed-rank")
                if not os.path.exists(marker):  # once: the restarted group goes on
                    open(marker, "w").close()
                    gate = ray.get_actor(config["gate"], namespace="coordinated_prep")
                    ray.get(gate.wait_open.remote(120), timeout=150)
                    os.kill(os.getpid(), signal.SIGKILL)
        np.savez(os.path.join(out, f"epoch{epoch}.npz"),
                 indices=np.concatenate([p[0] for p in parts]), repeats=np.concatenate([p[1] for p in parts]),
                 stream_epochs=np.concatenate([p[2] for p in parts]), digests=np.concatenate([p[3] for p in parts]),
                 batch_sizes=np.array([p[4] for p in parts]), start=loader.start_piece, world=loader.world,
                 private_samples=loader.private_samples, resumed_from=first,
                 node=ray.get_runtime_context().get_node_id(), coordinator=str(loader.coordinator))
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "epoch"), "w") as f:
                    f.write(str(epoch + 1))
                ray.train.report({"epoch": epoch + 1}, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report({"epoch": epoch + 1})
