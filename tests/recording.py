"""A Tune trainable that records what each trial saw, for the exactly-once and identity checks."""

from __future__ import annotations

import hashlib
import os

import numpy as np
from ray import tune

from coordinated_prep import train_loader


def sample_digests(images: np.ndarray) -> np.ndarray:
    """A 64-bit digest of each sample's bytes."""
    return np.array([int.from_bytes(hashlib.blake2b(img.tobytes(), digest_size=8).digest(), "little")
                     for img in images], dtype=np.uint64)


def record(config: dict) -> None:
    """Iterate ``epochs`` epochs; save per epoch: indices, stream epochs, digests, batch sizes."""
    out = os.path.join(config["out"], tune.get_context().get_trial_id())
    os.makedirs(out, exist_ok=True)
    loader = train_loader(config, batch_size=config["batch_size"])
    for epoch in range(config["epochs"]):
        parts = [(b.indices.numpy(), b.stream_epochs.numpy(), sample_digests(b.images.numpy()), len(b))
                 for b in loader]
        np.savez(os.path.join(out, f"epoch{epoch}.npz"),
                 indices=np.concatenate([p[0] for p in parts]), stream_epochs=np.concatenate([p[1] for p in parts]),
                 digests=np.concatenate([p[2] for p in parts]), batch_sizes=np.array([p[3] for p in parts]),
                 start=loader.start_piece, coordinator=str(loader.coordinator))
        tune.report({"epoch": epoch + 1, "score": float(config.get("score", 0.0)) * (epoch + 1)})


def load_records(out: str) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per trial id: the saved epochs in order."""
    records = {}
    for trial in sorted(os.listdir(out)):
        files = sorted(f for f in os.listdir(os.path.join(out, trial)) if f.endswith(".npz"))
        files.sort(key=lambda f: int(f[5:-4]))
        records[trial] = [dict(np.load(os.path.join(out, trial, f))) for f in files]
    return records
