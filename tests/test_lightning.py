"""A Lightning ``Trainer`` runs unchanged on the loaders: sanity validation, ``max_epochs``, early
stopping, checkpoint resume, epochs left unset; alone, and in a sweep whose trials share."""

from __future__ import annotations

import os

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from coordinated_prep import DataSpec, eval_loader, train_loader
from tests.harness import assert_exactly_once, stream_samples, train_ids




class Classifier(pl.LightningModule):
    """A linear model over 16 x 16 crops that records the indices of every batch it trains on."""

    def __init__(self, out: str | None = None) -> None:
        super().__init__()
        self.model = torch.nn.Linear(3 * 16 * 16, 3)
        self.out = out
        self.seen: list[list[int]] = []  # per training epoch (resumed ones included), the indices
        self.validated = 0  # validation batches, sanity checks included

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch, index):
        images, labels = batch
        images = images.float().sub_(127.5)  # an in-place op on the batch, as a loop normalising in place does
        self.seen[-1] += batch.indices.tolist()
        loss = torch.nn.functional.cross_entropy(self.model(images.flatten(1) / 128), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, index):
        images, labels = batch
        self.validated += 1
        loss = torch.nn.functional.cross_entropy(self.model(images.float().flatten(1) / 128 - 1), labels)
        self.log("val_loss", loss)

    def on_train_epoch_end(self) -> None:
        if self.out is not None:
            np.save(os.path.join(self.out, f"epoch{self.current_epoch}.npy"), np.asarray(self.seen[-1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _spec(dataset: str, **overrides) -> DataSpec:
    return DataSpec(**{"dataset": dataset, "pipeline": {"size": 16}, "seed": 2, "chunk_size": 16, "segments": 4,
                       **overrides})


def _trainer(max_epochs: int, root: str, **kwargs):
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=2, **kwargs)


def test_a_trainer_runs_unchanged_resumes_and_stops_early(small_dataset, tmp_path):
    spec = _spec(small_dataset, coordinated=False)
    train, val = train_loader(spec, 16, num_workers=0), eval_loader(spec, 8)  # epochs left unset
    model = Classifier()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _trainer(2, str(tmp_path), callbacks=[checkpoints]).fit(model, train_dataloaders=train, val_dataloaders=val)
    ids = train_ids(spec)
    assert len(model.seen) == 2
    for seen in model.seen:
        assert_exactly_once([np.asarray(seen)], ids)
    assert model.validated == 2 + 2 * len(val), "sanity steps, then a full validation pass per epoch"

    # Resumed from its last checkpoint with new loaders: epochs 3 and 4 follow, each whole.
    resumed = Classifier()
    train = train_loader(spec, 16, num_workers=0)
    _trainer(4, str(tmp_path)).fit(resumed, train_dataloaders=train, val_dataloaders=val,
                                   ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.current_epoch == 4 and len(resumed.seen) == 2
    for seen in resumed.seen:
        assert_exactly_once([np.asarray(seen)], ids)

    # Early stopping ends the fit before max_epochs; the loader's next iter() would be a whole epoch.
    stopping = pl.callbacks.EarlyStopping("val_loss", patience=0, min_delta=1e9, mode="min")
    early = Classifier()
    _trainer(10, str(tmp_path), callbacks=[stopping]).fit(early, train_dataloaders=train, val_dataloaders=val)
    assert 1 <= len(early.seen) < 10
    for seen in early.seen:
        assert_exactly_once([np.asarray(seen)], ids)


def lightning_trial(config: dict) -> None:
    """A Tune trial whose training loop is a Lightning Trainer over the shared loaders (epochs unset)."""
    from ray import tune

    out = os.path.join(config["out"], tune.get_context().get_trial_id())
    os.makedirs(out, exist_ok=True)
    model = Classifier(out)
    trainer = _trainer(config["epochs"], out)
    trainer.fit(model, train_dataloaders=train_loader(config, batch_size=config["batch_size"]),
                val_dataloaders=eval_loader(config, 8))
    tune.report({"epochs": len(model.seen), "validated": model.validated})


@pytest.mark.usefixtures("warm_pool")
def test_trainers_in_a_sweep_share_exact_epochs_and_prepare_nothing_past_them(ray_session, small_dataset, tmp_path):
    """A YAML sweep of a team's own trainable (a Lightning Trainer, epochs left unset, reporting none of
    the summary's columns): exact shared epochs, nothing prepared past them, and a summary whose
    columns come from what the loaders measured."""
    import textwrap

    from coordinated_prep.sweep.config import load_sweep
    from coordinated_prep.sweep.runner import run_sweep

    epochs, out = 3, tmp_path / "records"
    path = tmp_path / "lightning.yaml"
    path.write_text(textwrap.dedent(f"""
        name: lightning
        storage_path: {tmp_path / "runs"}
        trainable: tests.test_lightning:lightning_trial
        data: {{dataset: {small_dataset}, pipeline: {{size: 16}}, seed: 2, chunk_size: 16, segments: 4}}
        search_space: {{batch_size: {{grid: [8, 16]}}, epochs: {epochs}, out: {out}}}
        resources_per_trial: {{cpu: 0.25}}
        pool: {{keep_warm: true}}
        metric: validated
    """))
    summary = run_sweep(load_sweep(str(path)), verbose=0)
    rows = summary["trials"]
    assert [t["status"] for t in rows] == ["TERMINATED"] * 2, rows
    [(key, group)] = summary["groups"].items()
    spec = DataSpec(dataset=small_dataset, pipeline={"size": 16}, seed=2, chunk_size=16, segments=4)
    assert key == spec.group_key
    train = train_ids(spec)
    for row in rows:
        for e in range(epochs):
            assert_exactly_once([np.load(out / row["trial"] / f"epoch{e}.npy")], train)
        # The trainable reported neither its epoch nor its stalls: the loader measured them.
        assert row["epochs"] == epochs and 0 <= row["stall_fraction"] <= 1 and row["data_wait_s"] >= 0, row
    # Epochs unset: the group prepared the pieces from each trial's start through its last epoch, and
    # nothing past them (an undeclared trial's next epoch is prepared only once it begins it).
    assert group["samples_prepared"] == stream_samples(group["starts"].values(), epochs, len(train),
                                                       spec.chunk_size), group
    assert group["samples_served"] == 2 * epochs * len(train) > group["samples_prepared"], group
