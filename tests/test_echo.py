"""Data echoing (pure, no Ray): exact fresh epochs, the repeat bound, and auto's choices by counts."""

from __future__ import annotations

import numpy as np
import pytest

from coordinated_prep.trial.batching import Batcher
from coordinated_prep.pipeline.chunk import PreparedChunk, image_piece
from coordinated_prep.trial.echo import EchoCounts, EchoSpec, echoed
from coordinated_prep.errors import ConfigError
from tests.harness import assert_fresh_exactly_once


def _pieces(sizes: list[int], views: int = 1) -> list[PreparedChunk]:
    """Pieces of ``sizes`` samples (``views`` view-major copies each); pixels encode index and view."""
    out, index = [], 0
    for n in sizes:
        ids = np.tile(np.arange(index, index + n, dtype=np.int64), views)
        view = np.repeat(np.arange(views), n)
        pixels = ((ids * 7 + view) % 251).astype(np.uint8)
        images = np.broadcast_to(pixels[:, None, None, None], (n * views, 3, 2, 2)).copy()
        images.setflags(write=False)  # as a piece read from the object store is
        out.append(image_piece(images, ids % 5, ids, 0, views))
        index += n
    return out


def _epoch(sizes, batch_size, spec, ready=None, views=1, seed=0):
    """Run one epoch; returns the batches and a log of ("ready", answer) / ("batch", echo?) events."""
    log = []

    def answer(k):
        ok = ready(k) if ready is not None else True
        log.append(("ready", ok))
        return ok

    pieces = _pieces(sizes, views)
    fresh = Batcher(iter(pieces), batch_size, ready=answer, left=len(pieces))
    batches = []
    for b in echoed(fresh, spec, np.random.default_rng(seed)):
        batches.append(b)
        log.append(("batch", bool((b.repeats > 0).all())))
    return batches, log, sum(sizes)


def _rows(batches):
    return {"indices": np.concatenate([b.indices.numpy() for b in batches]),
            "repeats": np.concatenate([b.repeats.numpy() for b in batches])}


def _check_pixels(batches):
    """Each row's pixels are those of its sample (and view): echoes copy the right rows."""
    for b in batches:
        pixels = b.images.numpy()[:, 0, 0, 0]
        assert np.array_equal(pixels % 251, pixels), "pixels out of range"
        ids = b.indices.numpy()
        assert np.all(((pixels.astype(np.int64) - ids * 7) % 251) < 8), "a row's pixels are another sample's"


# ---- the setting ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, name", [
    (None, "off"), (1, "off"), ("off", "off"), (2, "example:2"), ("3", "example:3"), ("example:4", "example:4"),
    ("batch:2", "batch:2"), ("auto", "auto:4"), ("auto:6", "auto:6"), ({"mode": "batch", "factor": 3}, "batch:3"),
    (2.0, "example:2"),
])
def test_echo_settings_parse_to_their_names(value, name):
    assert EchoSpec.parse(value).name == name


@pytest.mark.parametrize("value", ["twice", "example:1", 0, -2, 17, "auto:1", True, {"mode": "sometimes"},
                                   {"factor": 2, "speed": 1}, [2]])
def test_bad_echo_settings_name_the_value_and_the_forms(value):
    with pytest.raises(ConfigError, match=r"config\.echo=.*use 1 or 'off'"):
        EchoSpec.parse(value, "config.echo")


# ---- exact epochs and the repeat bound, every variant ---------------------------------------------------------

VARIANTS = ["off", "example:2", "example:3", "batch:2", "batch:3", "auto:2", "auto:4"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("batch_size", [8, 16, 24])  # 24 straddles the 32-sample pieces
@pytest.mark.parametrize("views", [1, 2])
def test_every_variant_keeps_fresh_samples_exactly_once_and_repeats_bounded(variant, batch_size, views):
    spec = EchoSpec.parse(variant)
    never = (lambda k: False)  # a producer that is never ready: auto echoes all it may
    batches, _, n = _epoch([32, 32, 32, 20], batch_size, spec, ready=never, views=views)
    assert_fresh_exactly_once([_rows(batches)], range(n), views * spec.factor, variant)
    _check_pixels(batches)
    counts = EchoCounts()
    for b in batches:
        counts.add(b)
    assert counts.fresh == n
    if spec.mode in ("example", "batch"):  # a fixed factor: every row exactly e times
        assert counts.fresh + counts.echoed == views * spec.factor * n
        assert len(batches) == spec.batches_per_epoch(views * n, batch_size)
    assert all(0 < len(b) <= batch_size for b in batches)


def test_example_echo_keeps_a_repeat_out_of_its_originals_batch_while_the_buffer_allows():
    spec = EchoSpec("example", 3)  # buffer: 4 batches of fresh samples
    batches, _, n = _epoch([64] * 8, 16, spec)
    tail = spec.factor * spec.buffer_for(16) // 16  # the last batches may have too few distinct samples
    for k, b in enumerate(batches[:-tail]):
        ids = b.indices.numpy()
        assert np.unique(ids).size == ids.size, f"batch {k} holds a sample twice"
    sets = [frozenset(b.indices.tolist()) for b in batches]
    assert len(set(sets)) == len(sets), "each round is a new permutation: no batch's samples come together again"


@pytest.mark.parametrize("fresh_batches", [4, 5, 7])  # 5 and 7: a lone batch is left for the last group
def test_batch_echo_does_not_repeat_a_batch_right_after_itself(fresh_batches):
    batches, _, _ = _epoch([16] * fresh_batches, 16, EchoSpec("batch", 3))
    keys = [tuple(b.indices.tolist()) for b in batches]
    assert all(a != b for a, b in zip(keys, keys[1:]))
    assert len(set(keys)) == fresh_batches and len(keys) == 3 * fresh_batches


def test_a_batch_built_by_hand_is_all_fresh_and_a_piece_with_views_pickles_whole():
    import pickle

    import torch

    from coordinated_prep.trial.batching import Batch

    from coordinated_prep.pipeline.chunk import image_layout

    batch = Batch(image_layout((3, 2, 2)), [torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.tensor([1, 2])],
                  torch.tensor([5, 6]), torch.tensor([0, 0]))
    assert batch.repeats.tolist() == [0, 0]
    from tests.utils import image_chunk
    from coordinated_prep.pipeline.backends import make_preprocessor
    from coordinated_prep.pages import padded_base
    from coordinated_prep.pipeline.sources import open_source
    from coordinated_prep.spec import PipelineSpec

    chunk, _ = image_chunk(open_source("builtin:shapes"), make_preprocessor(PipelineSpec(size=16)), 0, 0,
                             np.arange(4), 16, views=3)
    again = pickle.loads(pickle.dumps(chunk))
    assert again.views == 3 and np.array_equal(again.images, chunk.images)
    assert padded_base(again.images) is not None, "the padded buffer travels whole, views and all"


# ---- auto: echoes exactly when the next fresh batch is not at hand -------------------------------------------

def test_auto_never_echoes_when_the_producer_is_always_ready():
    batches, log, n = _epoch([32] * 8, 16, EchoSpec.parse("auto"), ready=lambda k: True)
    assert all(int(b.repeats.max()) == 0 for b in batches)
    assert len(batches) == n // 16


def test_auto_echoes_up_to_its_cap_when_the_producer_is_never_ready():
    cap = 4
    batches, _, n = _epoch([16] * 16, 16, EchoSpec("auto", cap), ready=lambda k: False)
    counts = EchoCounts()
    for b in batches:
        counts.add(b)
    # Each fresh batch's samples are echoed until they reach the cap, and only then is fresh data
    # taken; after the last piece the epoch's end is at hand (ready), so its batch is not echoed.
    assert counts.fresh == n and counts.echoed == (cap - 1) * (n - 16)


def test_auto_echoes_only_after_a_not_ready_answer_and_never_after_a_ready_one():
    answers = iter([True, False] * 1000)  # a throttled producer: ready at every other look
    batches, log, n = _epoch([32] * 8, 16, EchoSpec("auto", 4), ready=lambda k: next(answers))
    echoes = 0
    for i, (kind, value) in enumerate(log):
        if kind == "batch" and value:  # an echo batch: the look just before it said "not ready"
            echoes += 1
            assert log[i - 1] == ("ready", False), log[max(0, i - 3) : i + 1]
        if kind == "ready" and value:  # a ready answer: the next batch is fresh
            following = next(v for k, v in log[i + 1 :] if k == "batch")
            assert following is False
    assert echoes > 0
    assert_fresh_exactly_once([_rows(batches)], range(n), 4, "auto")


def test_auto_waits_for_fresh_data_with_nothing_to_echo():
    # At an epoch's start nothing is buffered: the first batch is fresh whatever the producer says.
    batches, log, _ = _epoch([32] * 2, 16, EchoSpec("auto", 4), ready=lambda k: False)
    assert int(batches[0].repeats.max()) == 0
    assert log[0] == ("batch", False), "nothing to echo yet: no need to ask whether fresh data is ready"


# ---- views before augmentation: one decode, k deterministic and distinct views ---------------------------------

def test_views_are_deterministic_distinct_and_view_zero_is_the_plain_draw(monkeypatch):
    from coordinated_prep.pipeline.backends import make_preprocessor, torchvision_backend
    from tests.utils import image_chunk
    from coordinated_prep.pipeline.sources import open_source
    from coordinated_prep.spec import PipelineSpec

    source = open_source("builtin:shapes")
    prep = make_preprocessor(PipelineSpec(size=32, scale=(0.2, 1.0)))
    ids = np.arange(10, 26, dtype=np.int64)
    decodes = []
    real = torchvision_backend._decode
    monkeypatch.setattr(torchvision_backend, "_decode", lambda data: decodes.append(1) or real(data))
    three, _ = image_chunk(source, prep, 5, 2, ids, 32, views=3)
    assert len(decodes) == len(ids), "k views cost one decode per sample"
    again, _ = image_chunk(source, prep, 5, 2, ids, 32, views=3)
    plain, _ = image_chunk(source, prep, 5, 2, ids, 32)
    assert three.images.shape == (3 * len(ids), 3, 32, 32) and three.views == 3
    assert np.array_equal(three.images, again.images), "views are a pure function of seed, epoch, sample, view"
    assert np.array_equal(three.images[: len(ids)], plain.images), "view 0 is the draw without views"
    assert np.array_equal(three.indices, np.tile(ids, 3)) and np.array_equal(three.labels, np.tile(plain.labels, 3))
    by_view = three.images.reshape(3, len(ids), -1)
    for a, b in ((0, 1), (0, 2), (1, 2)):
        differ = sum(not np.array_equal(x, y) for x, y in zip(by_view[a], by_view[b]))
        assert differ == len(ids), f"views {a} and {b} coincide for {len(ids) - differ} samples"


def test_views_with_a_skipped_sample_close_the_gap_in_every_view():
    from coordinated_prep.pipeline.backends import make_preprocessor
    from tests.utils import image_chunk
    from coordinated_prep.errors import SampleError
    from coordinated_prep.pipeline.sources import open_source
    from coordinated_prep.spec import PipelineSpec

    source = open_source("builtin:shapes")

    class Broken:
        root, classes, labels = source.root, source.classes, source.labels

        def __len__(self):
            return len(source)

        def read(self, index):
            if index == 12:
                raise SampleError(index, "shape-12.png", "truncated")
            return source.read(index)

        def describe(self, index):
            return source.describe(index)

    prep = make_preprocessor(PipelineSpec(size=16))
    ids = np.arange(10, 16, dtype=np.int64)
    chunk, timing = image_chunk(Broken(), prep, 1, 0, ids, 16, on_error="skip", views=2)
    kept = np.array([10, 11, 13, 14, 15])
    assert [s[0] for s in timing.skipped] == [12]
    assert np.array_equal(chunk.indices, np.tile(kept, 2))
    whole, _ = image_chunk(source, prep, 1, 0, kept, 16, views=2)
    assert np.array_equal(chunk.images, whole.images)


# ---- through a trial's loader (its own process) -----------------------------------------------------------------

@pytest.mark.parametrize("echo", ["off", "example:2", "batch:2", "auto:3"])
def test_a_loader_with_views_and_echo_keeps_exact_epochs(echo):
    from coordinated_prep import DataSpec, train_loader
    from tests.harness import train_ids

    spec = DataSpec(pipeline={"size": 16}, coordinated=False, chunk_size=32, views=2, seed=4)
    loader = train_loader(spec, 24, epochs=2, echo=echo)
    epochs = [_rows(list(loader)) for _ in range(2)]
    factor = EchoSpec.parse(echo).factor
    assert_fresh_exactly_once(epochs, train_ids(spec), 2 * factor, echo)
    assert loader.epoch_counts.fresh == loader.samples_per_epoch
    if echo.startswith("auto"):
        with pytest.raises(TypeError, match="fresh_batches_per_epoch"):
            len(loader)
        # Unshared, the trial prepares its pieces itself, so fresh data is always at hand: no echo.
        assert loader.epoch_counts.echoed == loader.samples_per_epoch  # only the second view
    else:
        assert loader.echo_counts.batches == 2 * len(loader)


@pytest.mark.parametrize("echo", ["off", "example:2", "batch:2"])
def test_drop_last_leaves_out_the_short_last_batch_as_a_dataloaders_does(echo):
    """The built-in set's training split, 32 per batch: a DataLoader with drop_last=True yields only
    full batches, len() counts them, and no sample comes twice; the samples left out are fewer than
    a batch (and differ from epoch to epoch, as its shuffling's do)."""
    from coordinated_prep import DataSpec, train_loader
    from tests.harness import train_ids

    spec = DataSpec(pipeline={"size": 16}, coordinated=False, chunk_size=32, views=2, seed=4)
    loader = train_loader(spec, 32, epochs=2, echo=echo, drop_last=True)
    rows = 2 * len(train_ids(spec))
    assert rows % 32, "the split does not divide into batches: there is a short last batch to leave out"
    kept = rows - rows % 32
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == len(loader) == EchoSpec.parse(echo).batches_per_epoch(kept, 32)
        assert all(len(b) == 32 for b in batches)
        ids, views = np.concatenate([b.indices.numpy() for b in batches]), np.concatenate([b.repeats.numpy() for b in
                                                                                            batches])
        fresh = ids[views == 0]
        assert len(set(fresh.tolist())) == len(fresh) and len(train_ids(spec)) - len(fresh) < 32
    assert loader.fresh_batches_per_epoch == len(train_ids(spec)) // 32
    assert len(train_loader(spec, 32, epochs=1, drop_last=False)) == EchoSpec().batches_per_epoch(rows, 32)


# ---- the echo experiment's report (pure) ----------------------------------------------------------------------

def test_the_echo_report_measures_time_to_echo_offs_final_accuracy_per_seed():
    from coordinated_prep.bench.echo import summarize

    def rows(points):
        return [{"accuracy": a, "time_total_s": t, "fresh_samples_total": f, "echoed_samples_total": e,
                 "stall_fraction": s} for a, t, f, e, s in points]

    curves = {
        "off": {"0": rows([(0.6, 10, 100, 0, 0.8), (0.8, 20, 200, 0, 0.8)]),
                "1": rows([(0.7, 10, 100, 0, 0.6), (0.9, 20, 200, 0, 0.6)])},
        "auto": {"0": rows([(0.85, 11, 100, 150, 0.0), (0.9, 22, 200, 300, 0.0)]),
                 "1": rows([(0.8, 11, 100, 150, 0.1), (0.92, 22, 200, 300, 0.1)])},
        "slow": {"0": rows([(0.5, 10, 100, 0, 0.5), (0.7, 20, 200, 0, 0.5)]),
                 "1": rows([(0.9, 10, 100, 0, 0.5), (0.95, 20, 200, 0, 0.5)])},
    }
    result = summarize(curves, {"off": 30.0, "auto": 31.0})
    by = {r["variant"]: r for r in result["variants"]}
    assert result["targets"] == {"0": 0.8, "1": 0.9}
    assert by["off"]["time_to_target_s"] == 20 and by["off"]["speedup"] == 1.0
    assert by["auto"]["time_to_target_s"] == (11 + 22) / 2 and by["auto"]["fresh_to_target"] == 150
    assert by["auto"]["speedup"] == pytest.approx(20 / 16.5) and by["auto"]["echoed_samples"] == 600
    assert by["auto"]["stall_fraction"] == pytest.approx(0.05)
    assert by["slow"]["missed_seeds"] == ["0"] and by["slow"]["speedup"] is None
    assert (by["slow"]["final_min"], by["slow"]["final_max"]) == (0.7, 0.95)


def test_echo_experiment_files_are_validated_with_the_key_named(tmp_path):
    from coordinated_prep.bench.echo import load_echo

    good = "sweep: {trainable: small_cnn, search_space: {lr: 0.1, batch_size: 8, epochs: 1, model_seed: 0}}\n"
    for text, named in [
        (good.replace(", model_seed: 0", "") + "variants: [{name: 'off'}]\n", "model_seed is missing"),
        (good + "variants: [{name: auto, echo: auto}]\n", "must be distinct and include 'off'"),
        (good + "variants: [{name: 'off'}, {name: x, echo: twice}]\n", r"variants\[1\].echo='twice'"),
        (good + "variants: [{name: 'off'}, {name: v, views: 0}]\n", "variant 'v': data.views=0"),
        ("sweep: {}\nvariant: []\n", "keys 'sweep'"),
    ]:
        path = tmp_path / "echo.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=named):
            load_echo(str(path))


def test_coordprep_echo_dry_run_validates_the_shipped_file(capsys):
    from coordinated_prep.cli import main

    assert main(["echo", "experiments/echo.yaml", "--dry-run"]) == 0
    assert "5 variants: off, example-2, batch-2, views-2, auto" in capsys.readouterr().out
    assert main(["echo", "experiments/echo.yaml", "--dry-run", "--variants", "nope"]) == 2
    assert "--variants names ['nope']" in capsys.readouterr().err


def test_the_sweep_summary_shows_fresh_and_echoed_samples_per_trial_when_any_echoed():
    from coordinated_prep.sweep.summary import build_summary, format_summary

    rows = [{"trial": "a", "status": "TERMINATED", "epochs": 3, "accuracy": 0.9, "echo": "off",
             "fresh_samples": 300, "echoed_samples": 0},
            {"trial": "b", "status": "TERMINATED", "epochs": 3, "accuracy": 0.95, "echo": "auto:4",
             "fresh_samples": 300, "echoed_samples": 410}]
    text = format_summary(build_summary(rows, {}, "accuracy", "max"))
    assert "echoed" in text and "auto:4" in text and "410" in text
    plain = format_summary(build_summary([dict(rows[0])], {}, "accuracy", "max"))
    assert "echoed" not in plain, "no echo columns when nobody echoed"
