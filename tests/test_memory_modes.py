"""Memory modes: the same losses, weights and batch-norm statistics as memory: none; the budget plan."""

import contextlib
import functools

import pytest
import torch
from torch import nn

from coordinated_prep import ConfigError
from coordinated_prep.memory import modes
from coordinated_prep.memory.budget import OpRecord, choose
from coordinated_prep.memory.measure import SavedBytes
from coordinated_prep.memory.modes import apply_memory, memory_forward
from coordinated_prep.memory.spec import MemoryMode, parse_memory
from trainables import resnet, small_cnn

MODES = ["checkpoint", {"budget": 0.5}, {"budget": 0.3}]
MODELS = {"small_cnn": (small_cnn.build, {"width": 4}, 16), "resnet18": (resnet.build, {"width": 4}, 32)}


@functools.lru_cache(maxsize=None)
def _trained(name, mode_key):
    """``_train`` once per model and mode, shared by the tests that check its results."""
    return _train(name, MODES_BY_KEY[mode_key])


MODES_BY_KEY = {str(m): m for m in MODES + ["none"]}


def _train(name, mode, steps=2):
    """Train a small model ``steps`` steps on fixed data; returns the losses and the model."""
    build, config, size = MODELS[name]
    torch.manual_seed(0)
    model = apply_memory(build(5, config), mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, size, size, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


@pytest.fixture(scope="module")
def baselines():
    return {name: _trained(name, "none") for name in MODELS}


@pytest.mark.filterwarnings("ignore:memory budget")
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_losses_and_weights_match_none(baselines, name, mode):
    losses, model = _trained(name, str(mode))
    want, reference = baselines[name]
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert losses[0] != losses[1]  # the step did train
    for (k, v), (_, w) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.allclose(v.double(), w.double(), rtol=1e-5, atol=1e-6), k


@pytest.mark.filterwarnings("ignore:memory budget")
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_batch_norm_statistics_are_updated_once_per_step(baselines, name, mode):
    _, model = _trained(name, str(mode))
    norms = dict(_norms(model))
    for key, want in _norms(baselines[name][1]):
        assert torch.allclose(norms[key], want, rtol=1e-5, atol=1e-7), key
        if key.endswith("num_batches_tracked"):
            assert int(norms[key]) == 2


def test_without_the_protection_recomputation_updates_batch_norm_twice(baselines, monkeypatch):
    """The check above can fail: recomputing a stage does update the statistics again."""
    monkeypatch.setattr(modes, "kept_batch_norm_stats", lambda norms: contextlib.nullcontext())
    _, model = _train("small_cnn", "checkpoint")
    tracked = [v for k, v in _norms(model) if k.endswith("num_batches_tracked")]
    assert any(int(v) > 2 for v in tracked)


def _norms(model):
    return [(k, v) for k, v in model.state_dict().items() if "running" in k or "num_batches" in k]


def _saved(name, mode, size=32, batch=4):
    build, config, _ = MODELS[name]
    torch.manual_seed(0)
    model = apply_memory(build(5, config), mode)
    with SavedBytes(exclude=list(model.parameters())) as meter:
        model(torch.randn(batch, 3, size, size))
    return meter.nbytes, model


@pytest.mark.filterwarnings("ignore:memory budget")
def test_each_mode_keeps_less_and_a_budget_stays_within_it():
    none, _ = _saved("resnet18", "none")
    checkpoint, _ = _saved("resnet18", "checkpoint")
    half, model = _saved("resnet18", {"budget": 0.5})
    plan = next(iter(memory_forward(model).plans.values()))
    assert plan.none_bytes == none  # the profile counts what autograd saves without checkpointing
    assert checkpoint < half <= 0.5 * none
    assert half == plan.kept_bytes  # what the plan promised is what autograd holds
    assert any(plan.saves)


def test_evaluation_runs_the_plain_forward():
    build, config, size = MODELS["resnet18"]
    torch.manual_seed(0)
    plain = build(5, config).eval()
    torch.manual_seed(0)
    checkpointed = apply_memory(build(5, config), "checkpoint").eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(plain(x), checkpointed(x))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_copy_of_a_model_in_a_memory_mode_runs_its_own_modules_and_pickles(name):
    """An EMA or SWA model is a deepcopy of the model: its forward must run the copy's weights, in
    training (checkpointed) and in evaluation; and the model pickles (torch.save)."""
    import copy
    import io

    build, config, size = MODELS[name]
    torch.manual_seed(0)
    plain = build(5, config)
    model = apply_memory(copy.deepcopy(plain), "checkpoint")
    ema, plain_ema = copy.deepcopy(model), copy.deepcopy(plain)
    with torch.no_grad():
        for p, q in zip(ema.parameters(), plain_ema.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    x = torch.randn(2, 3, size, size)
    for train in (True, False):
        ema.train(train), plain_ema.train(train)
        assert torch.allclose(ema(x), plain_ema(x), atol=1e-6), f"train={train}: the copy ran the original's modules"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


def test_choose_takes_the_most_cost_per_byte_that_fits():
    ops = [OpRecord(0, "conv", 0, 100, 10_000.0, True), OpRecord(0, "relu", 0, 100, 100.0, True),
           OpRecord(1, "conv", 0, 50, 9_000.0, True), OpRecord(1, "mm", 0, 10, 50_000.0, False),
           OpRecord(1, "big", 0, 400, 1e9, True)]
    chosen = choose(ops, mandatory_bytes=40, budget_bytes=200)
    assert [(r.stage, r.op) for r in chosen] == [(1, "conv"), (0, "conv")]  # 'big' does not fit, 'mm' not saveable
    assert choose(ops, mandatory_bytes=300, budget_bytes=200) == []


def test_memory_values_are_validated():
    assert parse_memory(None) == MemoryMode() and parse_memory("checkpoint").kind == "checkpoint"
    assert parse_memory({"budget": 0.3}) == MemoryMode("budget", 0.3)
    assert parse_memory({"budget": 1}).label == "budget=1"
    for bad, words in (("chekpoint", "must be none, checkpoint"), ({"budget": 0}, "budget=0"),
                       ({"budget": 1.5}, "(0, 1]"), ({"budget": "x"}, "budget='x'"), (0.3, "0.3")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
            parse_memory(bad, "search_space.memory")
    with pytest.raises(ConfigError, match="takes no budget"):
        MemoryMode("checkpoint", 0.5)


def test_a_model_of_unknown_stages_is_a_config_error():
    class Custom(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="Custom"):
        apply_memory(Custom(), "checkpoint")
    model = Custom()
    assert apply_memory(model, "none") is model and memory_forward(model) is None


@pytest.mark.sweep  # trains for real in each mode
@pytest.mark.filterwarnings("ignore:memory budget")
def test_the_trainable_trains_alike_in_each_mode():
    """``fit`` reads ``memory`` from the trial config: one epoch on builtin:shapes gives the same losses."""
    from coordinated_prep import DataSpec
    from tests.test_trainables import MemorySession

    def run(memory):
        session = MemorySession()
        config = {"data": DataSpec(coordinated=False, pipeline={"size": 16}), "lr": 0.05, "batch_size": 64,
                  "epochs": 1, "width": 4, "memory": memory}
        small_cnn.fit(config, small_cnn.build, session)
        return session.reports[0], session.states[0]["model"]

    (base, weights), (checkpointed, weights_c) = run("none"), run({"budget": 0.5})
    assert checkpointed["train_loss"] == pytest.approx(base["train_loss"], rel=1e-5)
    assert checkpointed["loss"] == pytest.approx(base["loss"], rel=1e-4)
    assert torch.equal(weights["1.num_batches_tracked"], weights_c["1.num_batches_tracked"])
    with pytest.raises(ConfigError, match="memory='lots'"):
        run("lots")
