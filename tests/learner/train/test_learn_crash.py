"""Kill `flywheel learn` (SIGKILL) at arbitrary moments and restart it: no sample is lost, none is
trained twice, no version number is published twice and none is ever half-visible."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from rich.console import Console

from feedback import bus, db
from feedback.schemas import ModelVersion
from learner import store as S
from learner.tokenizer import load_tokenizer
from learner.train.learn import STATE_FILE, model_from_packed
from learner.train.pretrain import ensure_base_model, find_base_model, load_master_weights
from tests.helpers import scaled
from tests.learner.train.learn_support import make_corpus, reward_ids, tiny_learn_settings, write_samples

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def _toml(s, pretrain: dict, learn: dict) -> str:
    def val(v):
        return (
            json.dumps(v)
            if not isinstance(v, dict)
            else "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        )

    lines = [
        f"data_dir = {json.dumps(str(s.data_dir))}",
        f"cache_dir = {json.dumps(str(s.cache_dir))}",
        "[kafka]",
        f"port = {s.kafka.port}",
        f"controller_port = {s.kafka.controller_port}",
        "[pretrain]",
    ]
    lines += (
        [f"{k} = {val(v)}" for k, v in pretrain.items()] + ["[learn]"] + [f"{k} = {val(v)}" for k, v in learn.items()]
    )
    return "\n".join(lines) + "\n"


def _state(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)["state"]
    except Exception:  # being replaced right now
        return None


def test_learner_killed_and_restarted_loses_nothing(tmp_path, kafka_settings):
    corpus = make_corpus(tmp_path / "corpus")
    s = tiny_learn_settings(tmp_path, corpus, tmp_path / "cache", batch_size=4, min_samples=8, publish_every=0.5)
    s = s.model_copy(update={"kafka": kafka_settings.kafka})
    ensure_base_model(s, Console(file=io.StringIO()))
    base = find_base_model(s)
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    tok = load_tokenizer(base / "hf")
    served = model_from_packed(S.load_packed_artifact(base / "fp4"), load_master_weights(base)[1])
    import textwrap

    src = open(textwrap.__file__).read()
    write_samples(engine, served, tok, [src[i * 61 : i * 61 + 200] for i in range(48)])
    all_ids = reward_ids(engine)

    cfg = tmp_path / "flywheel.toml"
    # Staleness is not what this test is about: every sample comes from v0, and how many versions a
    # run publishes before the last ones are trained depends on the machine's speed. With the bound
    # out of the way, "lost" can only mean lost to a crash.
    cfg.write_text(
        _toml(
            s,
            s.pretrain.model_dump(mode="json"),
            {
                "batch_size": 4,
                "min_samples": 8,
                "publish_every": 0.5,
                "poll_s": 0.1,
                "max_staleness": 1000,
                "gate": {"sites": 6, "max_tokens": 8},
            },
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    state_path = s.learner_dir / STATE_FILE

    def learn(*extra):
        return subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "learn", "--config", str(cfg), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    kills = 0
    for extra_s in (
        0.0,
        1.3,
        2.9,
    ):  # once it has trained, kill it in whatever it is doing: an update, a save, a publish
        p = learn()
        start_step = (_state(state_path) or {}).get("step", 0)
        deadline = time.monotonic() + scaled(120)
        while (
            time.monotonic() < deadline
            and p.poll() is None
            and ((_state(state_path) or {}).get("step", 0) <= start_step)
        ):
            time.sleep(0.1)
        time.sleep(extra_s)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait(timeout=scaled(30))
    assert kills >= 2

    # Run to the end: every sample read and every full batch trained (and published if due).
    p = learn("--until-idle")
    out, _ = p.communicate(timeout=scaled(300))
    assert p.returncode == 0, out[-3000:]
    st = _state(state_path)
    trained = st["trained_ids"]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == all_ids[: len(trained)] and len(trained) == len(all_ids) // 4 * 4, "a sample was lost"

    store = S.open_store(S.default_store_uri(s))
    versions = store.versions()
    assert versions == list(range(len(versions))) and len(versions) >= 2
    with engine.connect() as conn:
        recorded = sorted(
            conn.execute(db.model_versions.select().with_only_columns(db.model_versions.c.version)).scalars()
        )
    assert recorded == versions  # every visible version recorded once (a primary key), none missing
    for v in versions:  # every visible version is complete and verifies
        store.materialize(v)
    c = bus.consumer(s.kafka, bus.VERSIONS, group_id=f"t-{uuid.uuid4().hex}", consumer_timeout_ms=int(scaled(5000)))
    announced = {ModelVersion.model_validate_json(m.value).version for m in c}
    c.close()
    assert set(versions) <= announced
