"""The decoded tier: its bookkeeping (safety after every step, liveness of every wait, without Ray), the
prefix/tail split, and real sweeps where groups with different tails share one prefix, by counts."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from ray import tune
from torchvision.transforms import v2

from coordinated_prep import CoordinatedSearcher, DataSpec, PoolSpec
from coordinated_prep.errors import ConfigError
from coordinated_prep.pipeline.chunk import prepare_chunk
from coordinated_prep.pipeline.probe import probe, train_indices
from coordinated_prep.pipeline.split import prefix_key, split_transform
from coordinated_prep.pipeline.transforms import make_pipeline
from coordinated_prep.tier.book import MINE, SELF, WAIT, Hit, TierBook
from tests.conftest import live_coordprep_actors
from tests.recording import record_digests  # a trial imports its trainable's module: this one is light
from tests.harness import assert_exactly_once
from tests.test_user_pipelines import _reference

TIMEOUT = 5.0
WHO = ("a", "b", "c")


class TierMachine(RuleBasedStateMachine):
    """Random claims, commits, releases and the passing of time by three prep actors on two
    prefixes; after every step the book is consistent, and every wait ends by its claim's deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.book = TierBook(capacity=10, claim_timeout_s=TIMEOUT)
        self.now = 0.0
        self.mine: dict[str, set[tuple[str, int]]] = {w: set() for w in WHO}  # what each was told is its own

    keys = st.tuples(st.sampled_from(["p", "q"]), st.integers(0, 5))

    @rule(who=st.sampled_from(WHO), prefix=st.sampled_from(["p", "q"]), ids=st.lists(st.integers(0, 5), max_size=4,
                                                                                     unique=True))
    def claim(self, who, prefix, ids):
        answers = self.book.claim(prefix, ids, who, self.now)
        for index, answer in zip(ids, answers):
            key = (prefix, index)
            if answer == MINE:
                assert self.book.claims[key].who == who
                self.mine[who].add(key)
            elif answer == WAIT:
                assert self.book.claims[key].who != who and self.book.claims[key].deadline > self.now
            elif isinstance(answer, Hit):
                assert self.book.entries[key] == answer
            else:
                assert answer == SELF and self.book.full

    @precondition(lambda self: any(self.mine.values()))
    @rule(data=st.data(), nbytes=st.integers(1, 6))
    def commit(self, data, nbytes):
        who = data.draw(st.sampled_from([w for w in WHO if self.mine[w]]))
        prefix = data.draw(st.sampled_from(sorted({p for p, _ in self.mine[who]})))
        ids = sorted(i for p, i in self.mine[who] if p == prefix)
        self.mine[who] -= {(prefix, i) for i in ids}
        before = self.book.used
        oid = self.book.commit(prefix, ids, nbytes, who)
        if oid is None:
            assert self.book.used == before
        else:
            assert self.book.used == before + nbytes
        assert not any((prefix, i) in self.book.claims for i in ids)

    @precondition(lambda self: any(self.mine.values()))
    @rule(data=st.data())
    def release(self, data):
        who = data.draw(st.sampled_from([w for w in WHO if self.mine[w]]))
        key = data.draw(st.sampled_from(sorted(self.mine[who])))
        self.mine[who].discard(key)
        self.book.release(key[0], [key[1]], who)

    @rule(seconds=st.floats(0.0, 2 * TIMEOUT))
    def time_passes(self, seconds):
        self.now += seconds

    @invariant()
    def budget_and_entries_are_consistent(self):
        assert 0 <= self.book.used <= self.book.capacity
        assert self.book.used == sum(o.nbytes for o in self.book.objects.values())
        for key, hit in self.book.entries.items():
            assert self.book.objects[hit.oid].keys[hit.pos] == key
            assert key not in self.book.claims, f"{key} is kept and claimed"

    @invariant()
    def every_wait_ends_by_its_deadline_without_anyone_acting(self):
        for prefix in ("p", "q"):
            ids = list(range(6))
            # DecodedTier.wait's loop, with nobody committing, releasing or claiming meanwhile: it
            # sleeps until the earliest live deadline and looks again; it must end, by now + TIMEOUT.
            answers, deadline = self.book.pending(prefix, ids, self.now)
            assert (WAIT in answers) == (deadline is not None)
            rounds = 0
            while deadline is not None:
                assert deadline <= self.now + TIMEOUT and rounds < len(ids)
                answers, deadline = self.book.pending(prefix, ids, deadline)
                rounds += 1
            assert WAIT not in answers


TestTierBook = TierMachine.TestCase
TestTierBook.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_full_tier_refuses_without_evicting_anything():
    book = TierBook(capacity=10, claim_timeout_s=1.0)
    assert book.claim("p", [0, 1], "a", 0.0) == [MINE, MINE]
    oid = book.commit("p", [0, 1], 8, "a")
    assert book.claim("p", [0, 1, 2], "b", 0.0) == [Hit(oid, 0), Hit(oid, 1), MINE]
    assert book.commit("p", [2], 4, "b") is None and book.full  # 12 > 10: not kept, nothing evicted
    assert book.claim("p", [0, 3], "c", 0.0) == [Hit(oid, 0), SELF]  # full: decode it yourself, do not offer
    assert book.used == 8 and book.entries[("p", 1)] == Hit(oid, 1)  # what was kept stays


def test_a_commit_the_object_store_refuses_is_withdrawn_and_closes_admission():
    """DecodedTier.commit keeps an object once ray.put took it; a put that raises (the store is full)
    withdraws the commit: nothing is kept that has no object, and nothing is charged for it."""
    book = TierBook(capacity=100, claim_timeout_s=1.0)
    book.claim("p", [0, 1, 2, 3], "a", 0.0)
    kept = book.commit("p", [0, 1], 8, "a")
    book.withdraw(book.commit("p", [2, 3], 8, "a"))
    assert book.used == 8 and book.full and set(book.entries) == {("p", 0), ("p", 1)} and list(book.objects) == [kept]
    assert book.claim("p", [1, 2], "b", 0.0) == [Hit(kept, 1), SELF], "the withdrawn: decode it yourself"
    assert (book.stats["kept"], book.stats["refused"]) == (2, 2)


def test_a_restarted_prep_actor_finds_its_claims_its_own_and_others_wait_only_until_the_deadline():
    book = TierBook(capacity=100, claim_timeout_s=2.0)
    assert book.claim("p", [0], "a", 0.0) == [MINE]
    assert book.claim("p", [0], "b", 1.0) == [WAIT]
    assert book.claim("p", [0], "a", 1.5) == [MINE]  # a retried piece of the same (restarted) actor
    assert book.pending("p", [0], 1.5) == ([WAIT], 3.5)
    assert book.pending("p", [0], 3.5) == ([SELF], None)  # expired: b decodes it itself
    assert book.claim("p", [0], "b", 3.6) == [MINE] and book.stats["expired"] == 1


def test_the_prefix_is_the_leading_deterministic_steps_and_its_key_their_parameters():
    rrc = v2.RandomResizedCrop(24, scale=(0.3, 1.0))
    steps, tail = split_transform(v2.Compose([v2.Resize(32), v2.CenterCrop(30), rrc, v2.Resize(20)]))
    assert [type(s) for s in steps] == [v2.Resize, v2.CenterCrop]
    assert isinstance(tail, v2.Compose) and tail.transforms[0] is rrc and len(tail.transforms) == 2
    resize = v2.Resize(32)
    assert split_transform(v2.Compose([resize])) == ([resize], None)  # all prefix: no tail
    assert split_transform(rrc) == ([], rrc)

    class MyResize(v2.Resize):  # a subclass may draw at random: tail unless it says otherwise
        pass

    assert split_transform(v2.Compose([MyResize(32), rrc]))[0] == []
    assert prefix_key("d", [v2.Resize(32)]) == prefix_key("d", [v2.Resize(32)]) != prefix_key("d", [v2.Resize(40)])
    assert prefix_key("d", []) == "decode:d" != prefix_key("e", [])
    # a repr may leave a parameter out (v2.ToDtype prints no dtype): the key has every public attribute
    f32, f16 = v2.ToDtype(torch.float32, scale=True), v2.ToDtype(torch.float16, scale=True)
    assert repr(f32) == repr(f16) and prefix_key("d", [f32]) != prefix_key("d", [f16])


def test_a_prefix_output_comes_back_as_the_kind_it_was_in_fresh_memory():
    from torchvision import tv_tensors

    from coordinated_prep.errors import StructureError
    from coordinated_prep.pipeline.split import pack, unpack

    image = tv_tensors.Image(torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2))
    for value, kind in ((image, tv_tensors.Image), (image.as_subclass(torch.Tensor), torch.Tensor),
                        (np.arange(4.0), np.ndarray)):
        packed = pack(value, "here")
        packed[0].flags.writeable = False  # as a kept output lies in the object store
        back = unpack(packed)
        assert type(back) is kind and np.array_equal(np.asarray(back), np.asarray(value))
        back[...] = 0  # the tail may write: its own copy
    with pytest.raises(StructureError, match="here: .*Mask"):
        pack(tv_tensors.Mask(torch.zeros(2, 2)), "here")
    # A decoded image is a (C, H, W) view of (H, W, C) memory: it comes back in that layout, which
    # torchvision's uint8 resize runs 2.6x as fast on as on a contiguous copy (for equal bytes).
    decoded = tv_tensors.Image(torch.arange(36, dtype=torch.uint8).reshape(3, 4, 3).permute(2, 0, 1))
    packed = pack(decoded, "here")
    assert packed[1] == "image/hwc" and packed[0].shape == (3, 4, 3) and packed[0].flags.c_contiguous
    back = unpack(packed)
    assert type(back) is tv_tensors.Image and torch.equal(back, decoded) and back.permute(1, 2, 0).is_contiguous()


def test_the_built_in_crop_and_a_user_transform_share_the_decode(small_dataset):
    builtin = make_pipeline(DataSpec(dataset=small_dataset))
    user = make_pipeline(DataSpec(dataset=small_dataset, transform=v2.RandomResizedCrop(24)))
    assert builtin.prefix_key == user.prefix_key == f"decode:{small_dataset}"
    [raw] = builtin.fetch([3], 0, 0)
    a, b = builtin.prefix(raw, 3), user.prefix(raw, 3)
    assert a[1] == b[1] and np.array_equal(a[0], b[0])


class _Noisy(torch.nn.Module):
    """A step that says it is deterministic and is not."""

    deterministic = True

    def forward(self, image):
        return image + torch.randint(0, 2, image.shape, dtype=image.dtype)


def test_a_prefix_step_that_draws_at_random_is_refused_at_the_start(small_dataset):
    pipeline = make_pipeline(DataSpec(dataset=small_dataset, transform=v2.Compose([_Noisy(), v2.RandomResizedCrop(24)])))
    with pytest.raises(ConfigError, match=r"_Noisy.*other values under other seeds.*deterministic = True"):
        probe(pipeline, 0, train_indices(len(pipeline), 0.1), ())


def test_kept_and_made_prefix_outputs_give_the_bytes_of_the_whole_pipeline(small_dataset):
    spec = DataSpec(dataset=small_dataset, transform=v2.Compose([v2.Resize(32), v2.RandomResizedCrop(24)]), views=2)
    pipeline = make_pipeline(spec)
    layout = probe(pipeline, 0, train_indices(len(pipeline), 0.1), (), 2).layout
    kept: dict = {}

    def tier(key, ids, produce):
        missing = [i for i in ids if (key, i) not in kept]
        kept.update({(key, i): v for i, v in zip(missing, produce(missing))})
        return [kept[(key, i)] for i in ids], len(missing), len(ids) - len(missing)

    ids = np.arange(12)
    plain, t0 = prepare_chunk(pipeline, layout, 0, 1, ids, views=2)
    first, t1 = prepare_chunk(pipeline, layout, 0, 1, ids, views=2, decoded=tier)
    again, t2 = prepare_chunk(pipeline, layout, 0, 1, ids, views=2, decoded=tier)
    assert (t0.decodes, t1.decodes, t2.decodes, t2.tier_hits) == (12, 12, 0, 12)
    for a, b, c in zip(plain.leaves, first.leaves, again.leaves):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    whole = torch.stack([pipeline.train(r, 0, 1, 5, 2)[1][0] for r in pipeline.fetch([5], 0, 1)])
    assert np.array_equal(plain.leaves[0][12 + 5], whole[0].numpy())  # view 1 of sample 5: view-major rows


# -- real sweeps: several tails, one prefix ---------------------------------------------------------

EPOCHS = 2
SCALES = (0.2, 0.5, 0.8)
#: The unshared pipeline's digest per (spec, stream epoch) and index, kept for the module's later sweeps
#: of the same specs: a sample's bytes are a function of (spec, stream epoch, index) alone.
_DIGESTS: dict[tuple[DataSpec, int], dict[int, int]] = {}


def _specs(dataset: str) -> list[DataSpec]:
    return [DataSpec(dataset=dataset, seed=1, chunk_size=16, segments=4, holdout=0.1,
                     transform=v2.Compose([v2.Resize(32, antialias=True), v2.RandomResizedCrop(24, scale=(s, 1.0)),
                                           v2.RandomHorizontalFlip()])) for s in SCALES]


def _sweep(tmp_path, specs: list[DataSpec], pool: PoolSpec):
    """One trial per group, all at once: what the tier shares is the decode across groups (sharing
    within a group is the coordinator's, tested elsewhere)."""
    searcher = CoordinatedSearcher(pool=pool)
    analysis = tune.run(tune.with_resources(record_digests, {"cpu": 0.1}),
                        config={"data": tune.grid_search(specs), "out": str(tmp_path), "epochs": EPOCHS},
                        search_alg=searcher, max_concurrent_trials=len(specs), verbose=0)
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    reports, tiers = searcher.group_reports(), searcher.decoded_reports()
    searcher.close()
    assert live_coordprep_actors() == []
    return analysis, reports, tiers


def _reference_digests(spec: DataSpec, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """:func:`_reference`, each (spec, stream epoch, index) prepared once in this process."""
    out = np.empty(len(indices), dtype=np.uint64)
    for e in np.unique(epochs):
        sel = epochs == e
        known = _DIGESTS.setdefault((spec, int(e)), {})
        todo = np.array([i for i in np.unique(indices[sel]).tolist() if i not in known], dtype=np.int64)
        if todo.size:
            known.update(zip(todo.tolist(), _reference(spec, np.full(todo.size, e), todo).tolist()))
        out[sel] = [known[i] for i in indices[sel].tolist()]
    return out


def _check_trials(analysis, tmp_path, specs: list[DataSpec]) -> None:
    """Each trial's epochs hold every training sample once, with the unshared pipeline's bytes."""
    train = train_indices(len(make_pipeline(specs[0])), specs[0].holdout)
    for trial in analysis.trials:
        spec = trial.config["data"]
        for e in range(EPOCHS):
            got = np.load(os.path.join(str(tmp_path), trial.trial_id, f"epoch{e}.npz"))
            assert_exactly_once([got["arr_0"]], train, trial.trial_id)
            assert np.array_equal(got["arr_2"], _reference_digests(spec, got["arr_1"], got["arr_0"])), \
                f"{trial.trial_id}: the bytes differ from the unshared pipeline's"


def test_groups_with_different_tails_decode_each_sample_once_for_the_whole_sweep(ray_session, tmp_path,
                                                                                   small_dataset, warm_pool):
    specs = _specs(small_dataset)
    analysis, reports, tiers = _sweep(tmp_path, specs, replace(warm_pool, actors=2))
    _check_trials(analysis, tmp_path, specs)
    n = len(train_indices(len(make_pipeline(specs[0])), 0.1))
    assert len(reports) == len(SCALES)
    prepared = sum(r["samples_prepared"] for r in reports.values())
    decodes = sum(r["decodes"] for r in reports.values())
    hits = sum(r["tier_hits"] for r in reports.values())
    # Three groups, at least two epochs each (a trial joining at a later segment reads into a third):
    # the prefix ran once per sample for all of it, and every other preparation was a hit.
    assert prepared >= len(SCALES) * EPOCHS * n and decodes == n and hits == prepared - n, (prepared, decodes, hits)
    [tier] = tiers.values()
    assert tier["samples"] == n and tier["kept"] == n and not tier["full"] and tier["used_bytes"] == n * 3 * 32 * 38
    by_epoch = {}
    for r in reports.values():
        for e, k in r["decodes_by_epoch"].items():
            by_epoch[int(e)] = by_epoch.get(int(e), 0) + k
    assert by_epoch.get(0) == n and not any(by_epoch.get(e) for e in (1, 2)), by_epoch


def test_a_tier_too_small_for_the_set_decodes_again_and_keeps_every_trial_live(ray_session, tmp_path, small_dataset,
                                                                                warm_pool):
    specs = _specs(small_dataset)[:2]
    n = len(train_indices(len(make_pipeline(specs[0])), 0.1))
    budget = (n // 3) * 3 * 32 * 38  # about a third of the set: admission closes part-way through epoch 0
    analysis, reports, tiers = _sweep(tmp_path, specs, replace(warm_pool, actors=2, decoded_bytes=budget))
    _check_trials(analysis, tmp_path, specs)
    [tier] = tiers.values()
    assert tier["full"] and 0 < tier["samples"] < n and tier["used_bytes"] <= budget
    prepared = sum(r["samples_prepared"] for r in reports.values())
    decodes = sum(r["decodes"] for r in reports.values())
    hits = sum(r["tier_hits"] for r in reports.values())
    assert decodes + hits == prepared and n < decodes < prepared, (decodes, hits, prepared)
    # A kept sample was decoded once and is a hit in every other group-epoch (at least 2 x 2 of them).
    assert hits >= (len(specs) * EPOCHS - 1) * tier["samples"], (hits, tier["samples"])


def test_without_a_tier_every_group_decodes_every_sample_each_epoch(ray_session, tmp_path, small_dataset, warm_pool):
    # One group is enough: with a tier its later epochs would be hits (decodes == n, as above).
    specs = _specs(small_dataset)[:1]
    n = len(train_indices(len(make_pipeline(specs[0])), 0.1))
    analysis, reports, tiers = _sweep(tmp_path, specs, replace(warm_pool, actors=2, decoded_fraction=0))
    assert tiers == {}
    [r] = reports.values()
    assert r["samples_prepared"] >= EPOCHS * n, r
    assert r["decodes"] == r["samples_prepared"] and r["tier_hits"] == 0, r


def test_a_wait_on_a_claim_that_is_never_committed_ends_at_its_deadline(ray_session, small_dataset):
    from coordinated_prep.tier.actor import DecodedTier
    from coordinated_prep.tier.client import TierClient

    tier = DecodedTier.remote(2**20, "node", 1.0)
    import ray

    assert ray.get(tier.claim.remote("p", [0, 1, 2], "ghost"))[0] == [MINE] * 3  # a claimer that never commits
    made = []

    def produce(ids):
        made.extend(ids)
        return [(np.full(4, i, dtype=np.uint8), "array") for i in ids]

    values, decodes, hits = TierClient(tier, "me", 1.0).outputs("p", [1, 2, 3], produce)
    assert made == [3, 1, 2] and (decodes, hits) == (3, 0)  # its own first, then the expired ones
    assert [int(v[0][0]) for v in values] == [1, 2, 3]
    # 3 was committed by "me"; a second reader is served it from the tier
    values, decodes, hits = TierClient(tier, "other", 1.0).outputs("p", [3], produce)
    assert (decodes, hits) == (0, 1) and int(values[0][0][0]) == 3 and made == [3, 1, 2]
    report = ray.get(tier.report.remote())
    assert report["expired"] == 0 and report["waits"] == 2 and report["samples"] == 1
    ray.kill(tier)
