"""The ``budget`` memory mode's plan: which op outputs to keep within a byte budget (MONeT-style).

One profiled forward, stage by stage, gives each op's output bytes and cost (FLOPs from
``torch.utils.flop_counter``'s formulas; one FLOP per output element for ops without a formula,
which are memory-bound), and the bytes autograd saves without checkpointing. The plan keeps each
checkpointed stage's input (as ``checkpoint`` does) and then, greedily, the outputs with the most
cost per byte while the total stays within ``budget`` times the unchecked activation bytes: the
convolutions and matrix products, whose recomputation is expensive, before the cheap batch-norm,
activation and pooling outputs. Everything not kept is recomputed in backward.

Costs are FLOP estimates, not timings, so the plan is the same on every run (a CPU spends more
time per FLOP in memory-bound ops than a GPU does, which the estimate ignores).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from coordinated_prep.memory.norms import batch_norms, kept_batch_norm_stats
from coordinated_prep.memory.stages import Stage


@dataclass(frozen=True)
class OpRecord:
    """One op call of the profiled forward.

    Attributes:
        stage: Index of the stage it ran in.
        op: The aten op (an ``OpOverload``).
        index: Its call number for that op within the stage (how selective checkpointing names it).
        nbytes: Bytes of its outputs.
        cost: Estimated FLOPs to recompute it.
        saveable: Whether keeping its output is sound: a new tensor, not mutated later, not the stage output.
    """

    stage: int
    op: Any
    index: int
    nbytes: int
    cost: float
    saveable: bool


@dataclass(frozen=True)
class BudgetPlan:
    """What each stage keeps: ``saves[i]`` holds ``(op, index)`` pairs of stage ``i``."""

    saves: tuple[frozenset[tuple[Any, int]], ...]
    none_bytes: int
    budget_bytes: int
    mandatory_bytes: int
    kept_bytes: int

    def describe(self) -> str:
        """One line for the log."""
        n = sum(len(s) for s in self.saves)
        return (f"keeps {self.kept_bytes / 2**20:.1f} MiB ({n} op outputs + stage inputs "
                f"{self.mandatory_bytes / 2**20:.1f} MiB) of a {self.budget_bytes / 2**20:.1f} MiB budget; "
                f"without checkpointing {self.none_bytes / 2**20:.1f} MiB")


def choose(records: Sequence[OpRecord], mandatory_bytes: int, budget_bytes: int) -> list[OpRecord]:
    """Greedy knapsack: the saveable records with the highest cost per byte that fit in what
    ``budget_bytes`` leaves after ``mandatory_bytes`` (a pure function)."""
    left = budget_bytes - mandatory_bytes
    chosen = []
    ranked = sorted((r for r in records if r.saveable and r.nbytes > 0), key=lambda r: -r.cost / r.nbytes)
    for r in ranked:
        if r.nbytes <= left:
            chosen.append(r)
            left -= r.nbytes
    return chosen


def plan_budget(stages: Sequence[Stage], x: torch.Tensor, fraction: float) -> BudgetPlan:
    """Profile one forward of ``stages`` on ``x`` and keep at most ``fraction`` of its activation bytes.

    The profile leaves batch-norm statistics as they were, and holds one stage's outputs at a time.
    """
    records, none_bytes, mandatory = profile(stages, x, batch_norms([m for s in stages for m in s.modules]),
                                             kept_batch_norm_stats)
    budget = int(fraction * none_bytes)
    if mandatory > budget:
        warnings.warn(f"memory budget={fraction:g}: the stage inputs alone take {mandatory} bytes, more than the "
                      f"budget of {budget} ({fraction:g} x {none_bytes}); keeping only them (as memory: checkpoint)",
                      stacklevel=3)
    chosen = choose(records, mandatory, budget)
    saves: list[set[tuple[Any, int]]] = [set() for _ in stages]
    for r in chosen:
        saves[r.stage].add((r.op, r.index))
    return BudgetPlan(tuple(frozenset(s) for s in saves), none_bytes, budget, mandatory,
                      mandatory + sum(r.nbytes for r in chosen))


def profile(stages: Sequence[Stage], x: torch.Tensor, norms: list, keep_stats: Any) -> tuple[list[OpRecord], int, int]:
    """Run the stages once with gradients on; returns the op records, the bytes autograd saves
    without checkpointing, and the bytes checkpointing must keep (stage inputs, the head's saves)."""
    params = {p.untyped_storage().data_ptr() for s in stages for m in s.modules for p in m.parameters()}
    records: list[OpRecord] = []
    none_bytes = mandatory = 0
    carried: set[int] = set()  # the previous stage's output, if autograd saved it there (counted once)
    with keep_stats(norms), torch.enable_grad():
        for i, stage in enumerate(stages):
            saved: dict[int, int] = {}
            with _Recorder(i) as rec, torch.autograd.graph.saved_tensors_hooks(_keeper(saved, params), lambda t: t):
                out = stage.fn(x)
            none_bytes += sum(n for p, n in saved.items() if p not in carried)
            if stage.checkpointed:
                mandatory += _storage_bytes(x)
            else:
                mandatory += sum(n for p, n in saved.items() if p not in carried)
            records += rec.finish(_ptr(out))
            carried = {_ptr(out)} & set(saved)
            x = out.detach().requires_grad_(True)
            del out, saved
    return records, none_bytes, mandatory


def _keeper(saved: dict[int, int], params: set[int]) -> Any:
    def pack(t: torch.Tensor) -> torch.Tensor:
        p = _ptr(t)
        if p not in params:
            saved[p] = _storage_bytes(t)
        return t

    return pack


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Recorder(TorchDispatchMode):
    """Records every op of one stage: output bytes, estimated cost, and which storages it wrote to."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self._stage = stage
        self._counts: dict[Any, int] = defaultdict(int)
        self._rows: list[tuple[Any, int, int, float, bool, set[int]]] = []
        self._written: set[int] = set()
        # Every output stays alive until finish(): a freed output's address could be reused by a tensor
        # written in place later, which would make the output look written (and the plan vary by run).
        self._alive: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        from torch.utils.checkpoint import SAC_IGNORED_OPS

        if func in SAC_IGNORED_OPS:  # selective checkpointing does not count them either
            return out
        index = self._counts[func]
        self._counts[func] += 1
        schema = func._schema
        for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self._written.add(_ptr(value))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._alive.append(tensors)
        ptrs = {_ptr(t) for t in tensors}
        fresh = not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns)
        nbytes = sum({_ptr(t): _storage_bytes(t) for t in tensors}.values())
        self._rows.append((func, index, nbytes, _cost(func, args, kwargs, out, tensors), fresh and bool(tensors), ptrs))
        return out

    def finish(self, output_ptr: int) -> list[OpRecord]:
        """The stage's records; an output written later in the stage, or the stage's output, is not saveable."""
        self._alive.clear()
        return [OpRecord(self._stage, f, i, n, c, ok and not (p & self._written) and output_ptr not in p)
                for f, i, n, c, ok, p in self._rows]


def _cost(func: Any, args: Any, kwargs: Any, out: Any, tensors: list[torch.Tensor]) -> float:
    """FLOPs by ``torch.utils.flop_counter``'s formula for ``func``, else one per output element."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - an op variant the formula does not take: fall back to the estimate
            pass
    return float(sum(t.numel() for t in tensors))
