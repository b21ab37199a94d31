"""learner.train.mismatch: a served version's train-inference mismatch on the completions it served,
with serving's routes replayed and without."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from feedback import db
from feedback.routing import encode_routing
from learner.formats import ModelFormat, SummaryFormat
from learner.model import ModelArgs, Transformer
from learner.train.learn import Sample
from learner.train.mismatch import ratio_interval, served_mismatch, served_samples
from tests.learner.train.learn_support import record_served, rerouted_samples

V = 300
FMT = ModelFormat((0,), 1, (), 64, None, SummaryFormat(False, (), (), "", ""))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelArgs.from_name("tiny", vocab_size=V, max_seq_len=64, init_std=0.3)).eval()


def test_replaying_servings_routes_removes_the_mismatch_its_other_experts_cause(model):
    samples = rerouted_samples(model, 12, reroute_every=4)
    m = served_mismatch(model, model.args, FMT, samples, version=3, batch_size=5)
    assert (m.version, m.completions) == (3, 12)
    assert m.tokens == sum(len(s.token_ids) for s in samples)
    assert m.own > 1e-3  # other experts at a quarter of the pairs move the logprobs
    assert m.replay < m.own / 1000 and m.ratio < 0.001  # serving's own routes reproduce vLLM's logprobs
    assert 0.2 < m.rerouted <= 0.25  # a shifted pair can land on the forward's own experts, never more
    lo, hi = m.ratio_interval
    assert lo <= m.ratio <= hi < 0.001
    assert m.as_dict()["ratio"] == m.ratio


def test_where_serving_routed_as_the_forward_does_replay_changes_nothing(model):
    seen = []
    m = served_mismatch(
        model, model.args, FMT, rerouted_samples(model, 6, reroute_every=0), version=0, progress=seen.append
    )
    assert m.rerouted == 0.0 and m.replay == m.own and m.own < 1e-6
    assert m.ratio is None and m.ratio_interval is None  # replay had nothing to remove: no ratio of roundings
    assert seen == [6]


def test_records_without_a_usable_trace_route_themselves_and_nothing_is_none(model):
    samples = rerouted_samples(model, 4, reroute_every=3)
    stripped = [replace(s, routing=encode_routing([[[0, 1]]])) for s in samples]  # another model's: 1 layer, 1 position
    m = served_mismatch(model, model.args, FMT, stripped, version=1)
    assert m.replay == m.own and m.rerouted == 0.0 and m.ratio is None  # another model's trace: not replayed
    assert served_mismatch(model, model.args, FMT, [], version=1) is None


def test_the_ratio_interval_resamples_completions():
    own = np.array([1.0, 1.0, 1.0, 1.0, 20.0, 1.0, 1.0, 1.0])  # one completion holds the rare reroute
    lo, hi = ratio_interval(own / 2, own)
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    replay = np.ones(8)  # replay removed the reroute's mismatch, and only there
    lo, hi = ratio_interval(replay, own)
    assert lo < replay.sum() / own.sum() < hi and hi == pytest.approx(1.0)  # a resample without it: no gain
    assert ratio_interval(np.ones(1), np.ones(1)) is None and ratio_interval(np.ones(3), np.zeros(3)) is None
    assert ratio_interval(replay, own, seed=1) == ratio_interval(replay, own, seed=1)


def test_served_samples_are_the_versions_newest_with_routes_oldest_first(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    trace = encode_routing([[[0, 1]] * 3])
    made = [
        Sample(0, f"c{i}", 0, version, [5, 6], tokens, [-0.5, -1.0 - i][: len(tokens)], 0.0, None, routing)
        for i, (version, routing, tokens) in enumerate(
            [
                (1, trace, [7, 8]),
                (2, trace, [7, 8]),
                (1, None, [7, 8]),
                (1, trace, [7, 8]),
                (1, trace, [7, 100]),  # another model's record: a token beyond this vocabulary
                (1, trace, [7, 8]),
            ]
        )
    ]
    record_served(engine, made)
    assert served_samples(engine, 1, 2, vocab_size=100) == [made[3], made[5]]
    assert [s.completion_id for s in served_samples(engine, 1, 10, vocab_size=100)] == ["c0", "c3", "c5"]
    assert [s.completion_id for s in served_samples(engine, 1, 2, vocab_size=101)] == ["c4", "c5"]
    assert served_samples(engine, 7, 10, vocab_size=100) == [] and served_samples(engine, 1, 0, vocab_size=100) == []
    engine.dispose()
