"""Kill `flywheel learn` (SIGKILL) at arbitrary moments and restart it: no sample is lost, none is
trained twice, no version number is published twice and none is ever half-visible. With
`--workers 2` (Ray Train) the kills hit the driver and, once, one of the training workers."""

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


def _ray_train_worker(driver_pid: int, deadline: float):
    """A Ray Train worker process of the learner driver `driver_pid` (its local Ray instance's descendant)."""
    import psutil

    while time.monotonic() < deadline:
        for c in psutil.Process(driver_pid).children(recursive=True):
            try:
                if "RayTrainWorker" in " ".join(c.cmdline()):
                    return c
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.2)
    raise AssertionError("no Ray Train worker found")


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_learner_killed_and_restarted_loses_nothing(tmp_path, kafka_settings, workers):
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
                "workers": workers,
            },
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    state_path = s.learner_dir / STATE_FILE

    logs = []

    def learn(*extra):
        """The CLI, its output in a file (Ray's log lines would fill a pipe nobody reads while it runs)."""
        logs.append(tmp_path / f"learn-{len(logs)}.log")
        with open(logs[-1], "w") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "learn", "--config", str(cfg), *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )

    kills = 0
    # Once it has trained, kill it in whatever it is doing: an update, a save, a publish. With workers,
    # the second kill hits a training worker (rank 0 or 1), whose death ends the run.
    for extra_s, target in ((0.0, "driver"), (1.3, "worker"), (2.9, "driver")):
        p = learn()
        start_step = (_state(state_path) or {}).get("step", 0)
        deadline = time.monotonic() + scaled(180 if workers > 1 else 120)
        while (
            time.monotonic() < deadline
            and p.poll() is None
            and ((_state(state_path) or {}).get("step", 0) <= start_step)
        ):
            time.sleep(0.1)
        time.sleep(extra_s)
        if p.poll() is None:
            victim = _ray_train_worker(p.pid, deadline) if workers > 1 and target == "worker" else p
            victim.send_signal(signal.SIGKILL)
            kills += 1
        try:
            p.wait(timeout=scaled(60))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert kills >= 2

    # Run to the end: every sample read and every full batch trained (and published if due).
    p = learn("--until-idle")
    p.wait(timeout=scaled(300))
    assert p.returncode == 0, logs[-1].read_text()[-3000:]
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
