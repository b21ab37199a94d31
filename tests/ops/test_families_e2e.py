"""Bring your own model, per family, the whole loop on CPU with real parts: a tiny random
checkpoint of the family (tests/learner/family_models.py: its transformers config class, its
special tokens by their real names far from id 0) -> `flywheel base import` -> vLLM inside Ray
Serve -> an OpenAI FIM request and a Tabby request -> feedback through Kafka and the sink into SQL
-> a learner update -> a delta published -> the replica swaps in place -> it serves the new
version, whose logprobs match the learner's.

One Ray for the module; each family deploys its own app (one vLLM engine, no canary pool) on its
own data folder (weight store, SQLite), and shares the session's Kafka broker (its sink group
starts at the topics' end, so it reads only its own records).
"""

from __future__ import annotations

import functools
import threading
import time
import uuid

import httpx
import pytest
import torch

from feedback import db, pools
from tests.helpers import flywheel, free_port, scaled, served_logprob_tolerance
from tests.learner.family_models import make_family_model

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.families]
TOKEN = "families-editor-token"
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def ray_serve() -> int:
    """Ray for the whole module, and the port of its HTTP proxy: each test deploys its app on it
    (serving.app.start), replacing the previous one."""
    from serving import app

    yield free_port()
    app.stop()


def family_settings(tmp_path, kafka_settings, folder, port: int):
    from ops.demo import DemoSettings
    from tests.learner.train.learn_support import make_corpus

    return DemoSettings(
        data_dir=tmp_path / "data",
        cache_dir=kafka_settings.cache_dir,
        kafka=kafka_settings.kafka,
        model={
            "base": str(folder),
            "min_confidence": 0.0,
        },  # a random test model is unsure of nearly every token: show all (the gate has tests of its own)
        serve={
            "port": port,
            "auth_tokens": [TOKEN],
            "ray_num_cpus": 2,
            "canary_replicas": 0,
            "context_budget": 256,
            "summary_chunk_tokens": 64,
            "pool_poll_s": 0.5,
            "engine": {"max_model_len": 512},
        },
        sink={
            "group_id": f"families-{uuid.uuid4().hex[:8]}",
            # events count within this window of their completion; the editor below sends them at
            # once, but a loaded machine can take seconds between its requests
            "feedback_window_s": scaled(10.0),
            "grace_period_s": 30.0,
            "sweep_interval_s": 0.2,
            "max_batch_wait_s": 0.2,
            "session_timeout_ms": 6000,
            "progress_interval_s": 2.0,
        },
        pretrain={"corpus": str(make_corpus(tmp_path / "corpus")), "heldout_fraction": 0.25},
        learn={
            "batch_size": 2,
            "min_samples": 2,
            "publish_every": 0.01,
            "lr": 3e-2,  # a step big enough that v1's logprobs differ from v0's beyond the tolerance
            "kl_coef": 0.0,
            "zstd_threads": 0,
            "gate": {"sites": 2, "min_sites": 1, "max_tokens": 4, "max_kl": 100.0, "reward_tolerance": 10.0},
        },
    )


def start_sink_at_the_end(s, said: list[str]) -> tuple[threading.Event, threading.Thread]:
    """The sink of this family, in a thread, its group committed at the topics' current end first;
    its progress lines go to `said`."""
    from kafka import TopicPartition

    from feedback import bus
    from feedback.sink.loop import run_sink

    c = bus.consumer(s.kafka, group_id=s.sink.group_id)
    parts = [TopicPartition(t, p) for t in (bus.COMPLETIONS, bus.EVENTS) for p in c.partitions_for_topic(t)]
    c.assign(parts)
    c.seek_to_end(*parts)
    for tp in parts:
        c.position(tp)
    c.commit()
    c.close()
    stop = threading.Event()
    t = threading.Thread(target=run_sink, args=(s,), kwargs={"stop": stop, "progress": said.append}, daemon=True)
    t.start()
    return stop, t


def wait_for(what: str, fn, timeout_s: float = 120, explain=lambda: ""):
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        if (got := fn()) is not None:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{explain()}")


def pipeline_state(s, engine, said: list[str], sink: threading.Thread) -> str:
    """Where records stopped: the topics' ends against the sink group's commits, the rows in SQL,
    and what the sink said (a timeout's message)."""
    from kafka import TopicPartition

    from feedback import bus

    c = bus.consumer(s.kafka, group_id=s.sink.group_id)
    try:
        parts = [TopicPartition(t, p) for t in (bus.COMPLETIONS, bus.EVENTS) for p in c.partitions_for_topic(t)]
        ends = c.end_offsets(parts)
        kafka = [f"{tp.topic}[{tp.partition}] end {ends[tp]} committed {c.committed(tp)}" for tp in parts]
    finally:
        c.close()
    with engine.connect() as conn:
        rows = {t.name: len(conn.execute(t.select()).all()) for t in (db.completions, db.events, db.rewards)}
        outcomes = [r.outcome for r in conn.execute(db.rewards.select())]
    return "\n".join(
        [f"sink thread alive: {sink.is_alive()}", *kafka, f"rows: {rows}, reward outcomes: {outcomes}", *said[-20:]]
    )


def records(engine, ids: list[str]) -> dict:
    """{completion_id: (prompt ids, [(token ids, logprobs, finish)])} once the sink stored all of `ids`."""
    with engine.connect() as conn:
        rows = conn.execute(db.completions.select().where(db.completions.c.completion_id.in_(ids))).all()
        choices = conn.execute(
            db.completion_choices.select()
            .where(db.completion_choices.c.completion_id.in_(ids))
            .order_by(db.completion_choices.c.choice_index)
        ).all()
    if len(rows) < len(ids):
        return None
    out = {r.completion_id: (list(r.prompt_token_ids), []) for r in rows}
    for ch in choices:
        out[ch.completion_id][1].append((list(ch.token_ids), list(ch.logprobs), ch.finish_reason))
    return out


def teacher_forced(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen]))[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(gen)), gen]


# The MoE family (FP4 experts, like the default model) runs again capped at AVX2 (`numerics`),
# where vLLM computes in float32; the others run once, to keep `make test` inside CI's time.
@pytest.mark.parametrize(
    "family",
    [
        pytest.param("qwen3_moe", marks=pytest.mark.numerics),
        "qwen2_moe",
        "qwen3",
        # Qwen2 differs from Qwen3 only in attention (biases, no q/k norms), which
        # tests/learner/test_families.py checks against transformers: run by `make test-extended`.
        pytest.param("qwen2", marks=pytest.mark.extended),
    ],
)
def test_the_whole_loop_on_an_imported_family(tmp_path, kafka_settings, ray_serve, family):
    from learner import store as S
    from learner.fim import fim_prompt_ids
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from learner.train.learn import Learner, model_from_packed
    from serving import app
    from serving.model_source import store_model_folder

    folder = make_family_model(tmp_path / "model", family, eos_bias=True, chat_eos=family == "qwen3_moe")
    s = family_settings(tmp_path, kafka_settings, folder, ray_serve)

    # import: the user's command
    r = flywheel("base", "import", str(folder), "--set", f"kafka.port={s.kafka.port}", tmp_path=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "imported" in r.stdout and "as v0 of" in r.stdout and "qwen FIM template" in r.stdout
    store = S.open_store(S.default_store_uri(s))
    assert store.versions() == [0] and store.base()["architecture"] in r.stdout
    tok, fmt = load_tokenizer(folder), read_format(folder)
    eos = set(fmt.eos_ids)
    assert 0 not in eos and tok.id_to_token(0) == "!"

    # serve the store's v0 in vLLM inside Ray Serve
    url = app.start(s, store_model_folder(s), 0, routers=())
    engine = db.make_engine(s.database_url)
    said: list[str] = []
    stop_sink, sink = start_sink_at_the_end(s, said)
    state = functools.partial(pipeline_state, s, engine, said, sink)
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=scaled(120))
    try:
        health = client.get("/v1/health").json()["flywheel"]
        assert health["prompt_format"]["fim"] == "qwen" and health["prompt_format"]["eos_ids"] == list(fmt.eos_ids)

        # an OpenAI FIM request, sampled: "!" (id 0) is likely at every step, EOS about a sixth of the time
        oa = client.post(
            "/v1/completions",
            json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 32, "temperature": 1.0, "seed": 7, "n": 4},
        )
        assert oa.status_code == 200, oa.text
        tabby = client.post(
            "/v1/completions",
            json={
                "language": "python",
                "segments": {
                    "prefix": PREFIX,
                    "suffix": SUFFIX,
                    "filepath": "pkg/calc.py",
                    "git_url": "https://github.com/acme/calc.git",
                },
                "temperature": 1.0,
                "seed": 3,
            },
        )
        assert tabby.status_code == 200, tabby.text
        oa_id, tabby_id = oa.json()["id"], tabby.json()["id"]
        # the editor's events, sent as an editor does: right after showing the suggestion
        for cid, events in ((oa_id, ["view", "select"]), (tabby_id, ["view", "dismiss"])):
            for kind in events:
                e = client.post("/v1/events", json={"type": kind, "completion_id": cid, "choice_index": 0})
                assert e.status_code == 200, e.text
        recs = wait_for("the completion records in SQL", lambda: records(engine, [oa_id, tabby_id]), explain=state)

        # the right template: the family's FIM tokens by name; the Tabby request's path and repository
        assert recs[oa_id][0] == fim_prompt_ids(fmt, tok, PREFIX, SUFFIX)
        assert recs[tabby_id][0] == fim_prompt_ids(fmt, tok, PREFIX, SUFFIX, path="pkg/calc.py", repo="calc")
        assert tok.decode(recs[tabby_id][0], skip_special_tokens=False).startswith(
            "<|repo_name|>calc\n<|file_sep|>pkg/calc.py\n<|fim_prefix|>"
        )
        # stops at the family's EOS, not at id 0 (the OpenAI request names no stop string; Tabby's stops
        # at a blank line too)
        sampled = recs[oa_id][1]
        assert any(0 in ids[:-1] for ids, _, _ in sampled), sampled  # "!" was written and generation went on
        stopped = [ids for ids, _, finish in sampled if finish == "stop"]
        middle_stops = eos | set(fmt.fim.stop_ids)  # a middle also ends at the template's own tokens
        assert stopped and all(ids[-1] in middle_stops for ids in stopped), sampled
        assert any(ids[-1] in eos for ids in stopped), sampled
        assert all(len(lps) == len(ids) for ids, lps, _ in sampled + recs[tabby_id][1])

        # feedback: the events, through Kafka and the sink, become rewards once the window closes
        def rewarded():
            with engine.connect() as conn:
                n = conn.execute(db.rewards.select().where(db.rewards.c.outcome != "unseen")).all()
            return n if len(n) >= 2 else None

        wait_for("the rewards", rewarded, explain=state)

        # the learner: an update on them, a delta published
        learner = Learner(s)
        learner.start()
        try:
            assert learner.state.version == 0 and learner.args.architecture == store.base()["architecture"]
            wait_for("samples", lambda: True if (learner.poll(), len(learner.buffer))[1] >= 2 else None)
            assert learner.update() is not None
            info = learner.publish()
        finally:
            learner.close()
        assert info["version"] == 1 and info["kind"] == "delta" and info["size_bytes"] < info["full_size_bytes"]
        v0 = model_from_packed(store.materialize(0), learner.args)
        v1 = model_from_packed(store.materialize(1), learner.args)

        # the replica swaps in place and serves v1
        pools.set_stable(engine, 1)
        wait_for(
            "the replica on v1",
            lambda: True if client.get("/v1/health").json()["flywheel"]["pools"]["stable"]["serving"] == 1 else None,
        )
        greedy = client.post("/v1/completions", json={"prompt": PREFIX, "max_tokens": 8, "temperature": 0})
        assert greedy.status_code == 200 and greedy.json()["model"] == "flywheel@v1", greedy.text
        rec = wait_for("the v1 record", lambda: records(engine, [greedy.json()["id"]]), explain=state)[
            greedy.json()["id"]
        ]
        prompt, ((ids, logprobs, _),) = rec
        served = torch.tensor(logprobs)
        tol = served_logprob_tolerance(v1, [(prompt, ids)], app.engine_precision(s.serve).dtype)
        d_new = (teacher_forced(v1, prompt, ids) - served).abs().max().item()
        d_old = (teacher_forced(v0, prompt, ids) - served).abs().max().item()
        print(f"\n{family}: |served - learner v1| {d_new:.4f}, tolerance {tol:.4f}; vs v0's weights {d_old:.4f}")
        assert d_new < tol and d_old > tol, (d_new, d_old, tol)  # v1's weights answered
        with engine.connect() as conn:
            swaps = [(w.pool, w.from_version, w.to_version, w.ok) for w in conn.execute(db.swap_events.select())]
        assert swaps == [("stable", 0, 1, True)]  # in place: no restart
        from ray import serve

        # the family's layers (biases, shared experts, dense MLPs, a tied output layer) took the
        # prepared reload: the pause only copied weights the worker built while serving
        status = serve.get_deployment_handle(app.deployment_name("stable"), app.APP_NAME).swap_status.remote()
        assert status.result(timeout_s=scaled(60))["last_swap"]["prepared"]
    finally:
        client.close()
        stop_sink.set()
        sink.join(60)
        from ray import serve

        serve.delete(app.APP_NAME)


def test_a_model_without_fim_tokens_serves_prefix_only(tmp_path, kafka_settings, ray_serve):
    from learner import store as S
    from learner.fim import plain_prompt_ids
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from serving import app
    from serving.model_source import store_model_folder
    from serving.replica import format_line

    folder = make_family_model(tmp_path / "model", "qwen3", fim=False)
    s = family_settings(tmp_path, kafka_settings, folder, ray_serve)
    r = flywheel("base", "import", str(folder), "--set", f"kafka.port={s.kafka.port}", tmp_path=tmp_path, timeout=300)
    assert r.returncode == 0 and "prefix-only (no FIM tokens)" in r.stdout, r.stderr
    tok, fmt = load_tokenizer(folder), read_format(folder)
    assert fmt.fim is None and "prefix-only" in format_line(fmt)  # what `flywheel serve` prints at start
    url = app.start(s, store_model_folder(s), 0, routers=())
    engine = db.make_engine(s.database_url)
    said: list[str] = []
    stop_sink, sink = start_sink_at_the_end(s, said)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=scaled(120)) as client:
            health = client.get("/v1/health").json()["flywheel"]["prompt_format"]
            assert health["prefix_only"] is True and health["fim"] is None
            r = client.post(
                "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            rec = wait_for(
                "the record",
                lambda: records(engine, [r.json()["id"]]),
                explain=functools.partial(pipeline_state, s, engine, said, sink),
            )[r.json()["id"]]
        assert rec[0] == plain_prompt_ids(fmt, tok, PREFIX)  # the suffix is dropped, no FIM tokens invented
        assert S.open_store(S.default_store_uri(s)).base()["fim"] is None
    finally:
        stop_sink.set()
        sink.join(60)
        from ray import serve

        serve.delete(app.APP_NAME)
