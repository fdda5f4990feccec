"""Memory modes on a model's training forward: ``none``, per-stage checkpointing, and a byte budget.

:func:`apply_memory` replaces the model's ``forward`` in place (its modules, parameters and
``state_dict`` are untouched). In training with gradients on, each stage of
:func:`~coordinated_prep.memory.stages.split_stages` but the head runs under non-reentrant
``torch.utils.checkpoint``: ``checkpoint`` keeps only the stage's input and recomputes the stage
in backward; ``budget`` also keeps the outputs that :mod:`coordinated_prep.memory.budget` chose,
through a selective-checkpoint policy. Evaluation and ``no_grad`` run the plain forward.

Batch norm: a recomputed stage runs its batch-norm layers again in training mode, which would
update their running statistics a second time. Each recomputation therefore restores the stage's
batch-norm buffers (running mean, variance, batches tracked) to what they were before it, so
they are updated once per step, as without checkpointing (``tests/test_memory_modes.py`` checks it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from coordinated_prep.memory.budget import BudgetPlan, plan_budget
from coordinated_prep.memory.norms import batch_norms, kept_batch_norm_stats  # re-exported: their old home
from coordinated_prep.memory.spec import MemoryMode, parse_memory
from coordinated_prep.memory.stages import Stage, split_stages

logger = logging.getLogger(__name__)


def apply_memory(model: nn.Module, mode: MemoryMode | Any) -> nn.Module:
    """Make ``model``'s training forward follow ``mode`` (a MemoryMode or a config value); returns ``model``.

    Raises:
        ConfigError: ``mode`` is not a valid memory mode, or the model's stages are unknown.
    """
    mode = parse_memory(mode)
    if mode.kind == "none":
        return model
    model.forward = _MemoryForward(model, split_stages(model), mode)  # an instance attribute: no new module
    return model


class _StageRun:
    """The function one checkpoint call runs: its first call is the forward, later ones recompute
    (and must not update batch-norm statistics again)."""

    def __init__(self, stage: Stage, norms: list[nn.Module]) -> None:
        self._stage, self._norms, self._calls = stage, norms, 0

    def __call__(self, x: Any) -> Any:
        self._calls += 1
        if self._calls == 1:
            return self._stage.fn(x)
        with kept_batch_norm_stats(self._norms):
            return self._stage.fn(x)


def _saving(saves: frozenset[tuple[Any, int]]) -> Any:
    """A selective-checkpoint ``context_fn``: save the ``(op, n-th call of it in the stage)`` outputs of
    ``saves``, recompute the rest. Calls are counted as selective checkpointing counts them, per op."""
    counts: dict[bool, dict[Any, int]] = {False: {}, True: {}}  # forward and recomputation count apart

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen = counts[ctx.is_recompute]
        index = seen.get(op, 0)
        seen[op] = index + 1
        return CheckpointPolicy.MUST_SAVE if (op, index) in saves else CheckpointPolicy.PREFER_RECOMPUTE

    def make() -> Any:
        for seen in counts.values():
            seen.clear()
        return create_selective_checkpoint_contexts(policy)

    return make


class _MemoryForward:
    """The replacement ``forward``: the stages, checkpointed in training as ``mode`` says.

    The stages are functions of the model's own modules, so a copy of the model (``copy.deepcopy``:
    an EMA or SWA model) or its pickle (``torch.save``) carries only the model and the mode, and
    splits its own modules into stages on its first forward.
    """

    def __init__(self, model: nn.Module, stages: list[Stage], mode: MemoryMode) -> None:
        self._model, self.mode = model, mode
        self._split: tuple[list[Stage], list[list[nn.Module]]] | None = (stages, [batch_norms(s.modules) for s in stages])
        self.plans: dict[tuple[Any, ...], BudgetPlan] = {}  # per input shape, dtype and device

    def __getstate__(self) -> dict[str, Any]:
        return {"_model": self._model, "mode": self.mode, "_split": None, "plans": {}}

    @property
    def _stages(self) -> list[Stage]:
        return self._stages_and_norms()[0]

    @property
    def _norms(self) -> list[list[nn.Module]]:
        return self._stages_and_norms()[1]

    def _stages_and_norms(self) -> tuple[list[Stage], list[list[nn.Module]]]:
        if self._split is None:  # a copy's: its own modules
            stages = split_stages(self._model)
            self._split = (stages, [batch_norms(s.modules) for s in stages])
        return self._split

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._model.training and torch.is_grad_enabled()):
            for stage in self._stages:
                x = stage.fn(x)
            return x
        saves = self._plan(x).saves if self.mode.kind == "budget" else None
        for i, (stage, norms) in enumerate(zip(self._stages, self._norms)):
            if not stage.checkpointed:
                x = stage.fn(x)
                continue
            extra = {} if saves is None else {"context_fn": _saving(saves[i])}
            # respect_saved_tensors_hooks: the outputs a policy saves go through the caller's hooks too,
            # so saved_tensors_hooks (the measurement of coordprep memory) see every tensor kept.
            x = checkpoint(_StageRun(stage, norms), x, use_reentrant=False, respect_saved_tensors_hooks=True, **extra)
        return x

    def _plan(self, x: torch.Tensor) -> BudgetPlan:
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.plans:
            self.plans[key] = plan_budget(self._stages, x, float(self.mode.budget))  # type: ignore[arg-type]
            logger.info("memory %s for input %s: %s", self.mode.label, tuple(x.shape), self.plans[key].describe())
        return self.plans[key]


def memory_forward(model: nn.Module) -> _MemoryForward | None:
    """The memory-mode forward :func:`apply_memory` installed on ``model``, if any."""
    forward = model.__dict__.get("forward")
    return forward if isinstance(forward, _MemoryForward) else None


__all__ = ["apply_memory", "batch_norms", "kept_batch_norm_stats", "memory_forward"]
