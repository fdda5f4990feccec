"""One training step's memory and time: saved activations (exact), parameter, gradient and
optimizer-state bytes, the peak, and the step time.

Activations are what autograd holds for backward at the end of the forward: every tensor packed by
``torch.autograd.graph.saved_tensors_hooks`` (with the memory modes, the checkpointed stage inputs
and the outputs a selective-checkpoint policy keeps), counted once per storage, parameters left out.

The peak: on CUDA, ``torch.cuda.max_memory_allocated`` over a step. On a CPU there is no allocator
to ask, so the peak is an *estimate*: parameters + gradients + optimizer state + the activations
saved at the end of the forward. It leaves out the transient memory of the backward pass (a
stage's recomputed activations, gradient temporaries), which checkpointing adds to on a GPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Iterable, Literal

import torch
from torch import nn


@dataclass(frozen=True)
class StepMemory:
    """What one configuration's training step holds and takes.

    Attributes:
        activation_bytes: Saved for backward at the end of the forward, deduplicated by storage.
        param_bytes: The model's parameters.
        grad_bytes: Their gradients after backward.
        optimizer_bytes: The optimizer's state (SGD's momentum buffers).
        peak_bytes: See ``peak_kind``.
        peak_kind: ``cuda_max_allocated`` (measured) or ``cpu_estimate`` (params + grads + optimizer
            + activations).
        step_s: Median seconds of the timed steps.
        step_min_s: The fastest timed step (the least disturbed by other processes).
        step_times: Each timed step's seconds.
    """

    activation_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    peak_kind: Literal["cuda_max_allocated", "cpu_estimate"]
    step_s: float
    step_min_s: float
    step_times: tuple[float, ...]


class SavedBytes:
    """A context that counts the bytes of the tensors autograd saves inside it, once per storage.

    Args:
        exclude: Tensors not to count (the parameters: they are memory of their own, not activations).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        """Bytes saved so far."""
        return sum(self._storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._exclude:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return t  # keeps the tensor exactly as autograd would

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
                 steps: int = 3, warmup: int = 1) -> StepMemory:
    """Train ``warmup`` steps, then ``steps`` timed steps; the first timed step is also measured.

    Args:
        model: The model in training mode, on the device of ``images``.
        optimizer: Its optimizer.
        images: One input batch (already normalised).
        labels: Its class labels.
        steps: Timed steps (at least 1).
        warmup: Untimed steps before them (the budget mode profiles its plan in the first).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure_step: steps={steps} must be >= 1 and warmup={warmup} >= 0")
    bench = StepBench(model, optimizer, images, labels)
    bench.warm_up(warmup)
    for _ in range(steps):
        bench.timed_step()
    return bench.result()


class StepBench:
    """One configuration's training step, stepped by the caller: ``coordprep memory`` interleaves the
    configurations on a CPU (one step of each per round), so that load from other processes falls
    on all of them alike."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
                 labels: torch.Tensor) -> None:
        self._model, self._optimizer, self._images, self._labels = model, optimizer, images, labels
        self._params = list(model.parameters())
        self._meter = SavedBytes(exclude=self._params)
        self._cuda = images.is_cuda
        self.times: list[float] = []

    def warm_up(self, steps: int) -> None:
        """Untimed steps (the budget mode profiles its plan in the first)."""
        for _ in range(steps):
            _step(self._model, self._optimizer, self._images, self._labels, None)
        if self._cuda:
            torch.cuda.synchronize()

    def timed_step(self) -> float:
        """One timed step; the first also counts the saved activations (and, on CUDA, the peak)."""
        first = not self.times
        if first and self._cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        _step(self._model, self._optimizer, self._images, self._labels, self._meter if first else None)
        if self._cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        if first and self._cuda:
            self._cuda_peak = torch.cuda.max_memory_allocated()
        return self.times[-1]

    def result(self) -> StepMemory:
        """The measurement, after at least one timed step."""
        if not self.times:
            raise ValueError("StepBench.result: no timed step yet")
        params = self._params
        sizes = {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(p.grad for p in params),
                 "optimizer_bytes": optimizer_bytes(self._optimizer)}
        if self._cuda:
            peak, kind = self._cuda_peak, "cuda_max_allocated"
        else:
            peak, kind = sum(sizes.values()) + self._meter.nbytes, "cpu_estimate"
        return StepMemory(self._meter.nbytes, peak_bytes=peak, peak_kind=kind, step_s=statistics.median(self.times),
                          step_min_s=min(self.times), step_times=tuple(self.times), **sizes)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
          meter: SavedBytes | None) -> None:
    if meter is None:
        logits = model(images)
    else:
        with meter:
            logits = model(images)
    loss = nn.functional.cross_entropy(logits, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
