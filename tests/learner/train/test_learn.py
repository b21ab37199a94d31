"""The learner on a tiny pretrained base: samples from SQL, updates, checkpoints, publishes."""

from __future__ import annotations

import io
import json
import os
import re
import stat

import pytest
import torch
from rich.console import Console

from feedback import db
from feedback.core.errors import UserError
from learner import delta as codec
from learner import show
from learner import store as S
from learner.model import ModelArgs
from learner.train.learn import (
    Learner,
    LearnerState,
    ReplayBuffer,
    Sample,
    describe,
    k3_BT,
    make_batch,
    model_from_packed,
    read_samples,
    save_state,
)
from learner.train.pretrain import ensure_base_model
from tests.learner.train.learn_support import (
    ListProducer,
    fim_prompts,
    make_corpus,
    reward_ids,
    tiny_learn_settings,
    write_samples,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(corpus, cache): a tiny base trained once for the module."""
    root = tmp_path_factory.mktemp("learnbase")
    corpus, cache = make_corpus(root / "corpus"), root / "cache"
    ensure_base_model(tiny_learn_settings(root, corpus, cache), Console(file=io.StringIO()))
    return corpus, cache


def started(tmp_path, base, **learn) -> Learner:
    corpus, cache = base
    s = tiny_learn_settings(tmp_path, corpus, cache / "..", **learn)
    s = s.model_copy(update={"cache_dir": cache})
    lr = Learner(s, producer=ListProducer())
    lr.start()
    return lr


def texts(n: int) -> list[str]:
    import textwrap

    src = open(textwrap.__file__).read()
    return [src[i * 97 : i * 97 + 300] for i in range(n)]


def test_replay_buffer_drops_stale_and_overflow():
    def s(i, v):
        return Sample(i, f"c{i}", 0, v, [1], [2], [-0.1], 0.0, "select")

    b = ReplayBuffer(max_staleness=2, capacity=4)
    b.add([s(1, 0), s(2, 1), s(3, 3), s(4, 3), s(5, 3)])
    assert b.dropped_overflow == 1 and [x.reward_id for x in b.items] == [2, 3, 4, 5]
    assert b.drop_stale(current_version=4) == 1 and b.dropped_stale == 1  # v1 lags 3 > 2
    assert [x.reward_id for x in b.take(2)] == [3, 4] and len(b) == 1
    c = ReplayBuffer(2, 4)
    c.load_state_dict(b.state_dict())
    assert [x.reward_id for x in c.items] == [5] and c.dropped_stale == 1


def test_the_learner_state_is_saved_owner_only(tmp_path):
    model = torch.nn.Linear(2, 2)
    old = os.umask(0o022)
    try:
        save_state(
            tmp_path / "data" / "learner" / "state.pt",
            model,
            torch.optim.SGD(model.parameters()),
            LearnerState(),
            ReplayBuffer(2, 4),
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "data" / "learner" / "state.pt").stat().st_mode) == 0o600
    assert {stat.S_IMODE((tmp_path / d).stat().st_mode) for d in ("data", "data/learner")} == {0o700}


def test_k3_is_never_negative_and_exact_where_the_logprobs_differ_by_rounding():
    # float32 logprobs a few ulps apart, as where serving computes in float32: exp(d) - d - 1
    # rounds to whole multiples of the epsilon there, and its mean came out negative
    g = torch.Generator().manual_seed(0)
    b = -torch.rand(4, 256, generator=g) * 8
    d = torch.randn(4, 256, generator=g) * torch.logspace(-9, -3, 256)
    a = b + d
    mask = torch.ones(4, 256)
    mask[:, -16:] = 0
    k = k3_BT(a, b, mask)
    d64 = a.double() - b.double()
    want = torch.expm1(d64) - d64
    assert (k >= 0).all() and (k[:, -16:] == 0).all()
    eps = torch.finfo(torch.float32).eps
    assert ((k.double() - want).abs() <= 4 * eps * d64.abs() + 1e-30)[:, :-16].all()
    old = (torch.exp(a - b) - (a - b) - 1) * mask  # the form it had: off by up to an epsilon
    assert (old < 0).any()


def test_make_batch_aligns_targets_with_positions():
    from learner.formats import ModelFormat, SummaryFormat

    args = ModelArgs.from_name("tiny", vocab_size=50, max_seq_len=8)
    eos, pad = 47, 49  # the format's ids, far from 0
    fmt = ModelFormat((eos, 48), pad, (), 8, None, SummaryFormat(False, (), (), "", ""))
    a = Sample(1, "a", 0, 0, [5, 6, 7], [8, 9, eos], [-1.0, -2.0, -3.0], 1.0, "select")
    b = Sample(2, "b", 0, 0, [1, 2, 3, 4, 5, 6, 7], [48], [-0.5], 0.0, "no_suggestion")  # abstain (the second EOS)
    c = Sample(3, "c", 0, 0, list(range(10, 20)), [30, 31], [-1.0, -1.0], -0.25, "dismiss")  # prompt cut to fit 8
    batch = make_batch([a, b, c], args, fmt)
    assert batch.abstain_B.tolist() == [False, True, False]
    assert batch.target_BT[1, 1:].tolist() == [pad] * (batch.target_BT.shape[1] - 1)  # padded with the pad token
    assert batch.input_BS.shape[1] <= 7
    for i, s in enumerate((a, b, c)):
        n = len(s.token_ids)
        assert batch.mask_BT[i].sum() == n
        for t in range(n):
            # the token at pos+1 of the full sequence is the target
            full = torch.cat([batch.input_BS[i], batch.target_BT[i, -1:]])
            assert batch.target_BT[i, t] == s.token_ids[t]
            assert int(batch.pos_BT[i, t]) + 1 <= len(full)
    assert batch.input_BS[2, :6].tolist() == [14, 15, 16, 17, 18, 19]  # the prompt's oldest tokens went
    assert batch.behaviour_BT[0].tolist() == [-1.0, -2.0, -3.0]


def test_start_publishes_the_base_as_v0_and_updates_save_everything(tmp_path, base):
    lr = started(tmp_path, base)
    assert lr.store.versions() == [0] and lr.state.version == 0
    assert [m.version for _, m in lr._producer.sent] == [0]
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(10))
    assert lr.poll() == 10 and lr.state.cursor == reward_ids(lr.engine)[-1]
    m = lr.update()
    assert m is not None and lr.state.step == 1 and len(lr.buffer) == 6
    # behaviour = the served v0 weights: the learner's FP4 forward reproduces them closely
    assert m["mismatch_kl_no_replay"] < 1e-3, m
    assert m["mismatch_kl_replay"] < 0.05, m
    before = {k: v.clone() for k, v in lr.model.state_dict().items()}
    assert lr.update() is not None and lr.update() is None  # 2 full batches; 2 samples wait

    again = Learner(lr.s, producer=ListProducer())
    again.start()  # resumes: same weights, cursor, buffer; v0 is not published again
    assert again.state.step == 2 and again.state.cursor == lr.state.cursor and len(again.buffer) == 2
    assert again.store.versions() == [0] and again._producer.sent == []
    assert any(not torch.equal(before[k], v) for k, v in again.model.state_dict().items())
    assert sorted(again.state.trained_ids) == reward_ids(lr.engine)[:8]


def test_the_learner_prompts_its_own_base_as_model_fim_says(tmp_path, base):
    """The gate replays the held-out sites in the format serving prompts with: `model.fim = "none"`
    serves Flywheel's own base prefix-only, so the learner's format has no FIM template either."""
    corpus, cache = base
    s = tiny_learn_settings(tmp_path, corpus, cache / "..").model_copy(update={"cache_dir": cache})
    plain = s.model_copy(update={"model": s.model.model_copy(update={"fim": "none"})})
    for settings, fim in ((s, "qwen-spm"), (plain, None)):  # auto: the template the base's export names
        lr = Learner(settings, producer=ListProducer())
        lr.start()
        assert (lr.format.fim.name if lr.format.fim else None) == fim


def test_unseen_and_malformed_samples_are_skipped_and_counted(tmp_path, base):
    lr = started(tmp_path, base)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(4), reward_fn=lambda t: (0.0, "unseen"))
    assert lr.poll() == 0 and lr.state.samples_skipped == 4 and lr.state.samples_read == 4
    # the confidence gate kept these from the editor: nobody saw them, nothing to learn
    write_samples(lr.engine, v0, lr.tok, texts(3), reward_fn=lambda t: (0.0, "withheld"))
    assert lr.poll() == 0 and lr.state.samples_skipped == 7 and lr.state.samples_read == 7


def test_a_sample_of_another_models_vocabulary_is_skipped_not_trained_on(tmp_path, base):
    """Another model's records (a shared database or broker) once made every update fail."""
    from sqlalchemy import update

    from feedback import db

    lr = started(tmp_path, base, min_samples=4, batch_size=4)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    foreign = write_samples(lr.engine, v0, lr.tok, texts(2))
    write_samples(lr.engine, v0, lr.tok, texts(4))
    with lr.engine.begin() as conn:
        conn.execute(
            update(db.completions)
            .where(db.completions.c.completion_id == foreign[0])
            .values(prompt_token_ids=[lr.args.vocab_size + 7])
        )
        conn.execute(
            update(db.completion_choices)
            .where(db.completion_choices.c.completion_id == foreign[1])
            .values(token_ids=[-1])
        )
    assert lr.poll() == 4 and lr.state.samples_skipped == 2
    assert lr.update() is not None


def test_one_user_supplies_at_most_max_samples_per_user_per_version_and_pinned_never_train(tmp_path, base):
    lr = started(tmp_path, base, max_samples_per_user=3, min_samples=4)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(10), user="mallory", reward_fn=lambda t: (1.0, "select"))
    write_samples(lr.engine, v0, lr.tok, texts(4), pinned=True, reward_fn=lambda t: (1.0, "select"))
    write_samples(lr.engine, v0, lr.tok, texts(5))  # five users, one sample each
    assert lr.poll() == 3 + 5
    assert (lr.state.samples_capped, lr.state.samples_skipped, lr.state.samples_read) == (7, 4, 19)
    assert [s.user_hash for s in lr.buffer.items].count("mallory") == 3 and not any(s.pinned for s in lr.buffer.items)
    assert "capped 7" in describe(lr.snapshot())

    assert lr.update() is not None  # saves the state: the cursor with the counts behind it

    again = Learner(lr.s, producer=ListProducer())
    again.start()
    write_samples(again.engine, v0, again.tok, texts(2), user="mallory", seed=1)
    assert again.poll() == 0 and again.state.samples_capped == 9
    again.publish()  # a new version: every user may contribute again
    write_samples(again.engine, v0, again.tok, texts(5), user="mallory", seed=2)
    assert again.poll() == 3 and again.state.samples_capped == 11


def test_read_samples_pages_by_reward_id(tmp_path, base):
    lr = started(tmp_path, base)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(5))
    ids = reward_ids(lr.engine)
    first, last = read_samples(lr.engine, 0, limit=3)
    assert [s.reward_id for s in first] == ids[:3] and last == ids[2]
    rest, last = read_samples(lr.engine, last, limit=3)
    assert [s.reward_id for s in rest] == ids[3:] and last == ids[-1]
    assert read_samples(lr.engine, last, limit=3) == ([], last)


def test_publish_gates_stores_a_delta_records_and_announces(tmp_path, base):
    lr = started(tmp_path, base, min_samples=8, publish_every=0.01)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(8))
    lr.poll()
    assert not lr.publish_due()  # nothing trained yet
    updates = [lr.update(), lr.update()]
    assert lr.publish_due()
    info = lr.publish()
    assert info["version"] == 1 and info["parent"] == 0 and info["kind"] == "delta"
    # the version's mismatch: the means over its updates, and how many they cover
    for name in ("mismatch_kl_replay", "mismatch_kl_no_replay", "recorded_routing"):
        assert info["metrics"][name] == pytest.approx(sum(m[name] for m in updates) / 2)
    assert info["metrics"]["mismatch_updates"] == 2
    assert info["gate_passed"], info["gate_reason"]
    assert info["size_bytes"] < info["full_size_bytes"]
    with lr.engine.connect() as conn:
        row = conn.execute(db.model_versions.select().where(db.model_versions.c.version == 1)).one()
    assert row.gate_passed and row.metrics["heldout.n"] == 6 and "kl_to_stable" in row.metrics
    assert [m.version for _, m in lr._producer.sent] == [0, 1]
    assert lr.state.version == lr.state.last_good == 1 and lr.state.trained_since_publish == 0
    # the published version is the learner's weights, quantized: what serving will load
    served = S.to_hf_tensors(lr.store.materialize(1))
    mine = S.to_hf_tensors(S.pack_checkpoint(lr.model.state_dict()))
    assert all(torch.equal(served[k], mine[k]) for k in served)


def test_publish_fits_a_show_policy_on_what_users_saw_and_keeps_it_across_a_restart(tmp_path, base):
    """learner/show.py: every trained sample users saw is an outcome; at publish the policy fitted
    on them goes into the version's manifest and its row's metrics. Too few outcomes: the last
    good version's policy (here none). `learn.show.enabled = false`: none at all."""
    learn = {"min_samples": 16, "batch_size": 16, "publish_every": 0.01, "show": {"min_samples": 24, "min_each": 4}}
    lr = started(tmp_path, base, **learn)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(16))
    lr.poll()
    lr.update()
    assert len(lr.state.show_rows) == 16 and sum(r[-1] for r in lr.state.show_rows) == 8  # odd ones accepted
    # each row reads the line before its cursor back from the prompt, as serving read it from the request
    samples, _ = read_samples(lr.engine, 0, limit=16)
    expected = [
        show.features(s.behaviour, lr.tok.decode(s.token_ids), show.cursor_line(lr.tok.decode(s.prompt_ids)))
        for s in samples
    ]
    assert sorted(r[:-1] for r in lr.state.show_rows) == sorted(expected)
    assert any(f[len(show.LOGPROB_FEATURES) :] != expected[0][len(show.LOGPROB_FEATURES) :] for f in expected)
    info = lr.publish()  # 16 outcomes: too few to fit
    assert info["gate_passed"] and lr.store.show_policy(1) is None and lr.state.show_policy is None
    # rows an older Flywheel kept (the five logprob features and the label) are not fitted on
    lr.state.show_rows = [[-1.0, -1.0, -2.0, 1.0, 2.0, float(i % 2)] for i in range(40)] + lr.state.show_rows
    write_samples(lr.engine, v0, lr.tok, texts(16), version=1, seed=1)
    lr.poll()
    lr.update()
    info = lr.publish()
    policy = lr.store.show_policy(2)
    assert policy is not None and (policy.samples, policy.accepts) == (32, 16) and policy.explore == 0.05
    assert policy.features == show.FEATURES
    assert info["metrics"]["show_policy_samples"] == 32 and lr.state.show_policy == policy.as_dict()
    again = started(tmp_path, base, **learn)
    assert len(again.state.show_rows) == 72 and again.state.show_policy == policy.as_dict()

    off = started(tmp_path / "off", base, **learn | {"show": {"enabled": False}})
    write_samples(off.engine, v0, off.tok, texts(16))
    off.poll()
    off.update()
    off.publish()
    assert off.state.show_rows == [] and off.store.show_policy(1) is None


def test_what_the_show_policy_withheld_is_kept_for_its_bound_and_the_gates_is_not(tmp_path, base):
    """A `withheld` record the confidence gate would have shown was withheld by a show policy: no
    outcome, but part of what the gate showed, which `learn.show.max_withheld` is a share of."""
    lr = started(tmp_path, base)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)

    def withheld(tokens):
        return 0.0, "withheld"

    write_samples(lr.engine, v0, lr.tok, texts(6), reward_fn=withheld)
    lr.poll()  # the tiny base is unsure of every first token: the gate (0.25) withheld them
    assert lr.state.show_withheld == [] and len(lr.buffer) == 0
    lr.s = lr.s.model_copy(update={"model": lr.s.model.model_copy(update={"min_confidence": 0.0})})
    write_samples(lr.engine, v0, lr.tok, texts(6), reward_fn=withheld, seed=1)
    lr.poll()  # no gate: a policy withheld these
    assert len(lr.state.show_withheld) == 6 and len(lr.buffer) == 0  # never trained on


def test_only_the_weights_train_weights_names_change_and_only_they_are_in_the_delta(tmp_path, base):
    """learn.train_weights freezes the rest: the updates leave it as the base's, bit for bit, so a
    published version differs from its parent only in the trained tensors."""
    experts = r"mlp\.experts\."
    lr = started(tmp_path, base, min_samples=8, publish_every=0.01, lr=1e-3, train_weights=[experts])
    before = {k: v.clone() for k, v in lr.model.state_dict().items()}
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(lr.engine, v0, lr.tok, texts(8))
    lr.poll()
    assert lr.update() is not None and lr.update() is not None
    after = lr.model.state_dict()
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(re.search(experts, k) for k in changed), sorted(changed)
    info = lr.publish()
    assert info["version"] == 1 and info["kind"] == "delta", info
    old, new = (codec.tensor_hashes(lr.store.materialize(v)) for v in (0, 1))
    in_delta = {k for k in new if new[k] != old[k]}
    assert in_delta and all(re.search(experts, k) for k in in_delta), sorted(in_delta)


def test_a_train_weights_pattern_that_matches_no_weight_stops_the_learner(tmp_path, base):
    with pytest.raises(UserError, match=r"learn.train_weights: 'lora_' matches no weight of this model"):
        started(tmp_path, base, train_weights=["experts", "lora_"])


class PaysForAbstaining:
    """A deliberately hacked reward: +1 for an empty suggestion, -1 for anything shown."""

    abstain_every = 2

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, toks):
        return (1.0, "no_suggestion") if len(toks) == 1 and toks[0] == self.eos else (-1.0, "dismiss")


def test_a_hacked_reward_is_blocked_by_the_gate_and_the_learner_reverts(tmp_path, base):
    # Every weight trains, the output layer's too, so ten updates are enough for the hack to take
    # hold (with the default, the experts alone, they reached a KL to the base of 0.015: too
    # little drift for any check to block, or to need to).
    lr = started(
        tmp_path, base, min_samples=8, publish_every=0.01, lr=3e-2, kl_coef=0.0, batch_size=16, train_weights=[".*"]
    )
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    write_samples(
        lr.engine,
        v0,
        lr.tok,
        fim_prompts(lr.tok, lr.train_files, 160, lr.args.max_seq_len),
        reward_fn=PaysForAbstaining(lr.format.eos_id),
    )
    lr.poll()
    good = {k: v.clone() for k, v in lr.model.state_dict().items()}
    while lr.update() is not None:
        pass
    info = lr.publish()
    # The property: a policy trained to abstain is blocked by a reward-hacking check. Which check
    # fires first depends on how far the machine's numerics let it drift (the suggestion rate
    # collapsing, or the KL spike that collapse takes), so any of them will do.
    hacking_checks = ("suggestion_rate", "kl", "reward_divergence", "completion_length", "heldout_reward")
    assert not info["gate_passed"], json.dumps(info["metrics"], default=str)
    assert any(c in info["gate_reason"] for c in hacking_checks), (info["gate_reason"], info["metrics"])
    assert info["metrics"]["heldout"]["suggestion_rate"] <= info["metrics"]["stable_heldout"]["suggestion_rate"]
    with lr.engine.connect() as conn:
        row = conn.execute(db.model_versions.select().where(db.model_versions.c.version == 1)).one()
    assert not row.gate_passed and row.gate_reason == info["gate_reason"]
    assert lr.state.last_good == 0 and lr.state.version == 1  # v1 is stored (for inspection), never served
    assert all(torch.equal(good[k], v) for k, v in lr.model.state_dict().items())  # back on v0's weights


def test_a_learner_that_died_before_its_first_save_adopts_its_v0(tmp_path, base):
    lr = started(tmp_path, base)
    (lr.dir / "state.pt").unlink()  # died after publishing v0, before saving
    again = Learner(lr.s, producer=ListProducer())
    again.start()
    assert again.store.versions() == [0] and [m.version for _, m in again._producer.sent] == [0]
    S.open_store(S.default_store_uri(lr.s)).publish(S.pack_checkpoint(again.model.state_dict()), parent=0)
    (lr.dir / "state.pt").unlink()
    with pytest.raises(Exception, match="already holds versions"):
        Learner(lr.s, producer=ListProducer()).start()


def test_a_restarted_learner_adopts_only_its_own_versions(tmp_path, base):
    """Killed after STABLE, a learner records its version on restart; a version another publisher
    wrote meanwhile (the demo's degraded candidate, a damaged one) is not its own: it is neither
    recorded again nor announced, and never becomes the parent of the learner's next delta."""
    from learner.publish import publish_version

    lr = started(tmp_path, base, min_samples=4, publish_every=0.01)
    other = dict(lr.store.materialize(0))
    other["lm_head.weight"] = -other["lm_head.weight"]
    publish_version(
        lr.store, other, parent=0, engine=lr.engine, producer=ListProducer(), gate_passed=True, gate_reason="not mine"
    )
    again = Learner(lr.s, producer=ListProducer())
    again.start()
    assert (again.state.version, again.state.last_good) == (0, 0) and again._producer.sent == []
    with again.engine.connect() as conn:
        row = conn.execute(db.model_versions.select().where(db.model_versions.c.version == 1)).one()
    assert row.gate_reason == "not mine" and "learner_step" not in row.metrics

    write_samples(again.engine, model_from_packed(again.store.materialize(0), again.args), again.tok, texts(4))
    again.poll(), again.update()
    info = again.publish()
    assert (info["version"], info["parent"]) == (2, 0)
    # died after STABLE, before recording v3: the restart records it, as its own
    again.store.publish(again._packed(), parent=2)
    third = Learner(lr.s, producer=ListProducer())
    third.start()
    assert third.state.version == 3 and [m.version for _, m in third._producer.sent] == [3]


def test_the_learner_waits_out_a_database_outage_and_loses_nothing(tmp_path, base, monkeypatch):
    """A database restart cut the learner's poll, then its publish between STABLE and recording the
    version: it exited with `internal error: OperationalError` before. Now it waits, tries again,
    and records the version it had stored, once, as its own."""
    import threading

    from sqlalchemy.exc import OperationalError

    import learner.publish
    import learner.train.learn as L

    lr = started(tmp_path, base, min_samples=4, publish_every=0.01, db_retry_s=0.01)
    write_samples(lr.engine, model_from_packed(lr.store.materialize(0), lr.args), lr.tok, texts(4))
    down = {"poll": 1, "record": 1}  # how many calls each still fails

    def outage(name, real):
        def call(*args, **kwargs):
            if down[name]:
                down[name] -= 1
                raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(L, "read_samples", outage("poll", L.read_samples))
    monkeypatch.setattr(learner.publish, "record", outage("record", learner.publish.record))
    lr.run(threading.Event(), until_idle=True)
    assert down == {"poll": 0, "record": 0}
    assert lr.store.versions() == [0, 1] and (lr.state.version, lr.state.last_good) == (1, 1)
    with lr.engine.connect() as conn:
        rows = conn.execute(db.model_versions.select()).all()
    assert [r.version for r in rows] == [0, 1] and rows[1].metrics["learner_step"] == lr.state.step
    assert [m.version for _, m in lr._producer.sent] == [0, 1]


def test_staleness_counts_from_the_version_users_are_served_not_the_newest_published(tmp_path, base):
    """Versions the rollout has not reached, and blocked ones, no longer make served samples stale."""
    from feedback import pools

    lr = started(tmp_path, base, min_samples=4, batch_size=4, max_staleness=1)
    v0 = model_from_packed(lr.store.materialize(0), lr.args)
    lr.state.version, lr.state.last_good = 5, 3  # v4, v5 blocked; stable still serves v1
    pools.set_stable(lr.engine, 1)
    write_samples(lr.engine, v0, lr.tok, texts(3), version=0)  # 1 behind stable: kept
    assert lr.poll() == 3 and len(lr.buffer) == 3 and lr.buffer.dropped_stale == 0
    pools.set_stable(lr.engine, 3)  # the rollout caught up: v0's samples are now 3 behind
    write_samples(lr.engine, v0, lr.tok, texts(1), version=3, seed=1)
    lr.poll()
    assert lr.buffer.dropped_stale == 3 and [s.version for s in lr.buffer.items] == [3]
