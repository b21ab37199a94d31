"""The weight store: publish protocol (STABLE last), chains and full snapshots, materialize,
planning, retention, and the announce/record helpers."""

import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from feedback import bus, db
from feedback.schemas import ModelVersion
from learner import delta as D
from learner import store as S
from learner.export import checkpoint_tensors, export_packed_fp4, fp4_dequantized
from learner.model import ModelArgs, Transformer
from tests.helpers import scaled
from tests.learner.test_delta import train_steps


@pytest.fixture(scope="module")
def chain():
    """Packed checkpoints of a tiny model after 0, 2, 4, ... AdamW steps (6 versions), and the model at the end."""
    torch.manual_seed(0)
    args = ModelArgs.from_name("tiny", vocab_size=512, max_seq_len=64)
    model = Transformer(args)
    model.init_weights(0.02)
    out = [S.pack_checkpoint(model.state_dict())]
    for v in range(1, 6):
        train_steps(model, 2, lr=1e-5, seed=v)
        out.append(S.pack_checkpoint(model.state_dict()))
    return out, model, args


def publish_all(store: S.Store, ckpts, n: int | None = None):
    msgs = []
    for v, c in enumerate(ckpts[:n]):
        msgs.append(store.publish(c, parent=v - 1 if v else None))
    return msgs


def test_publish_writes_stable_last_and_a_complete_manifest(tmp_path, chain):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path.as_uri(), full_every=100)
    m0, m1 = publish_all(store, ckpts, 2)
    assert (m0.kind, m0.parent, m1.kind, m1.parent) == ("full", None, "delta", 0)
    layout = {}
    for v in (0, 1):
        folder = tmp_path / f"v00000{v}"
        (attempt,) = [p for p in folder.iterdir() if p.is_dir()]  # one publish, one attempt folder
        assert sorted(p.name for p in folder.iterdir()) == sorted(["STABLE", attempt.name])
        layout[v] = attempt.name, sorted(p.name for p in attempt.iterdir())
    assert layout[0][1] == ["full.safetensors", "manifest.json"] and layout[1][1] == ["delta.zst", "manifest.json"]
    attempt = tmp_path / "v000001" / layout[1][0]
    man = json.loads((attempt / "manifest.json").read_text())
    assert (man["version"], man["parent"], man["base_version"], man["kind"]) == (1, 0, 0, "delta")
    assert man["files"]["delta"] == {
        "name": f"{attempt.name}/delta.zst",
        "sha256": hashlib.sha256((attempt / "delta.zst").read_bytes()).hexdigest(),
        "size": (attempt / "delta.zst").stat().st_size,
    }
    assert man["tensor_hash"] == D.HASH == "blake3"
    assert man["tensors"]["lm_head.weight"]["hash"] == D.tensor_hash(ckpts[1]["lm_head.weight"])
    assert man["digest"] == D.checkpoint_digest(D.tensor_hashes(ckpts[1])) and man["created_at"] and man["description"]
    # STABLE names the manifest and holds its sha256
    assert (tmp_path / "v000001" / "STABLE").read_text() == f"{m1.sha256} {attempt.name}/manifest.json\n"
    assert m1.sha256 == hashlib.sha256((attempt / "manifest.json").read_bytes()).hexdigest()
    assert m1.uri == (tmp_path / "v000001").as_uri() and m1.size_bytes == (attempt / "delta.zst").stat().st_size
    print(
        f"\ndelta v0->v1: {m1.size_bytes} B, full {m1.full_size_bytes} B (1/{m1.full_size_bytes / m1.size_bytes:.1f})"
    )
    assert m1.size_bytes * 4 < m1.full_size_bytes


class Crash(BaseException):
    """Stands for the process dying: no `except Exception` in the store runs after it."""


def test_a_crash_mid_publish_leaves_nothing_visible(tmp_path, chain, monkeypatch):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path)
    publish_all(store, ckpts, 2)

    def crash(self, path, data):
        raise Crash("the publisher died before its STABLE marker")

    monkeypatch.setattr(S.Store, "_create", crash)
    with pytest.raises(Crash):
        store.publish(ckpts[2], parent=1)
    monkeypatch.undo()
    (attempt,) = (tmp_path / "v000002").iterdir()
    assert sorted(p.name for p in attempt.iterdir()) == ["delta.zst", "manifest.json"]  # the files are there ...
    reader = S.open_store(tmp_path)  # ... but no reader takes the version
    assert reader.versions() == [0, 1] and reader.latest() == 1
    assert list(reader.unfinished()) == [f"v000002/{attempt.name}"]
    with pytest.raises(S.StoreError):
        reader.materialize(2)
    # the next publish of that number goes through (in a folder of its own) ...
    assert store.publish(ckpts[2], parent=1).version == 2 and S.open_store(tmp_path).versions() == [0, 1, 2]
    assert D.tensor_hashes(S.open_store(tmp_path).materialize(2)) == D.tensor_hashes(ckpts[2])
    # ... and cleanup removes the leftovers, format 1's temporary folders too, under the lock
    (tmp_path / ".tmp-v000009-deadbeef").mkdir()
    (tmp_path / ".tmp-v000009-deadbeef" / "delta.zst").write_bytes(b"x")
    assert reader.cleanup(keep=10) == [] and reader.unfinished() == {}
    assert not attempt.exists() and not (tmp_path / ".tmp-v000009-deadbeef").exists()
    assert D.tensor_hashes(S.open_store(tmp_path).materialize(2)) == D.tensor_hashes(ckpts[2])


def write_format_1(store: S.Store, root: Path) -> None:
    """Rewrite a local store's versions in format 1 (before attempt folders): manifest.json and the
    payloads beside STABLE, which holds the manifest's sha256 alone."""
    for v in store.versions():
        folder = root / f"v{v:06d}"
        (attempt,) = [p for p in folder.iterdir() if p.is_dir()]
        manifest = json.loads((attempt / "manifest.json").read_text())
        for info in manifest["files"].values():
            info["name"] = info["name"].split("/")[1]
            (attempt / info["name"]).rename(folder / info["name"])
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        (folder / "manifest.json").write_bytes(raw)
        (folder / "STABLE").write_text(hashlib.sha256(raw).hexdigest() + "\n")
        (attempt / "manifest.json").unlink()
        attempt.rmdir()


def test_a_store_written_in_format_1_still_opens(tmp_path, chain):
    """Stores written before attempt folders: read, planned, verified, extended and cleaned as before."""
    ckpts, _, _ = chain
    publish_all(S.open_store(tmp_path, full_every=3), ckpts, 4)
    write_format_1(S.open_store(tmp_path), tmp_path)
    assert sorted(p.name for p in (tmp_path / "v000001").iterdir()) == ["STABLE", "delta.zst", "manifest.json"]
    (tmp_path / "v000004").mkdir()  # a format-1 publish that crashed before its STABLE
    (tmp_path / "v000004" / "delta.zst").write_bytes(b"half")
    store = S.open_store(tmp_path, full_every=3)
    assert store.versions() == [0, 1, 2, 3] and store.unfinished().keys() == {"v000004/delta.zst"}
    for v in range(4):
        store.verify(v)
        assert D.tensor_hashes(S.open_store(tmp_path).materialize(v)) == D.tensor_hashes(ckpts[v])
    assert store.publish(ckpts[4], parent=3).version == 4  # the leftover folder takes the new attempt beside it
    assert store.cleanup(keep=2) == [0, 1, 2] and store.versions() == [3, 4]
    assert store.unfinished() == {} and D.tensor_hashes(S.open_store(tmp_path).materialize(4)) == D.tensor_hashes(
        ckpts[4]
    )


def test_a_store_begun_before_blake3_still_reads_and_goes_on_in_sha256(tmp_path, chain, monkeypatch):
    """Format 2 named no tensor hash and kept each tensor's sha256: such a store verifies, and
    its new versions keep their parent's hash, so each delta's base table is its parent's."""
    ckpts, _, _ = chain
    with monkeypatch.context() as m:
        m.setattr(D, "HASH", "sha256")
        publish_all(S.open_store(tmp_path, full_every=3), ckpts, 4)
    for v in range(4):  # rewrite the manifests as format 2 wrote them, and STABLE to match
        folder = tmp_path / f"v{v:06d}"
        (attempt,) = [p for p in folder.iterdir() if p.is_dir()]
        manifest = json.loads((attempt / "manifest.json").read_text())
        assert manifest.pop("tensor_hash") == "sha256"
        manifest["format"] = "flywheel-weight-store/2"
        manifest["tensors"] = {n: {"sha256": t.pop("hash"), **t} for n, t in manifest["tensors"].items()}
        raw = (json.dumps(manifest, indent=1) + "\n").encode()
        (attempt / "manifest.json").write_bytes(raw)
        (folder / "STABLE").write_text(f"{hashlib.sha256(raw).hexdigest()} {attempt.name}/manifest.json\n")
    store = S.open_store(tmp_path, full_every=3)
    for v in range(4):
        store.verify(v)
        assert store.hash_algorithm(v) == "sha256" and store.hashes(v) == D.tensor_hashes(ckpts[v], "sha256")
        assert D.tensor_hashes(S.open_store(tmp_path).materialize(v)) == D.tensor_hashes(ckpts[v])
    assert store.publish(ckpts[4], parent=3).version == 4
    assert store.hash_algorithm(4) == "sha256" and store.manifest(4)["format"] == S.FORMAT
    reader = S.open_store(tmp_path)
    assert D.tensor_hashes(reader.materialize(4)) == D.tensor_hashes(ckpts[4]) and reader.plan(4, have=3).deltas == (4,)
    # the learner's and the importer's checks of version 0 hash with the store's own hash
    assert reader.hashes(0) == D.tensor_hashes(ckpts[0], reader.hash_algorithm(0))


def test_full_snapshot_every_n_versions_and_materialize(tmp_path, chain):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path, full_every=3)
    msgs = publish_all(store, ckpts)
    assert [m.kind for m in msgs] == ["full", "delta", "delta", "full", "delta", "delta"]
    assert "delta" in store.manifest(3)["files"] and "full" in store.manifest(3)["files"]  # a full one keeps its delta
    for reader in (S.open_store(tmp_path), store):  # cold (from snapshots) and warm (cached)
        for v in (5, 1, 4, 2):
            assert D.tensor_hashes(reader.materialize(v)) == D.tensor_hashes(ckpts[v])
    got = S.open_store(tmp_path).materialize(5)
    assert all(
        torch.equal(D.parts(got[n])[0].view(torch.uint8), D.parts(ckpts[5][n])[0].view(torch.uint8)) for n in got
    )


def test_plan_takes_deltas_from_what_the_reader_holds(tmp_path, chain):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path, full_every=3)
    publish_all(store, ckpts)
    assert store.plan(5, have=4).deltas == (5,) and store.plan(5, have=4).have == 4
    p = store.plan(5, have=1)  # a delta chain 2..5 is still smaller than snapshot 3 + delta 4, 5
    assert (p.have, p.full, p.deltas) == (1, None, (2, 3, 4, 5))
    p = store.plan(5)  # a cold reader starts from the nearest full snapshot
    assert (p.have, p.full, p.deltas) == (None, 3, (4, 5))
    assert store.plan(2, have=4).full == 0  # not an ancestor: from a snapshot
    got, hashes = store.fetch(store.plan(5, have=1), ckpts[1])
    assert hashes == D.tensor_hashes(ckpts[5]) == store.hashes(5)
    with pytest.raises(S.StoreError):
        store.plan(9)


def test_corrupt_payloads_are_rejected(tmp_path, chain):
    ckpts, _, _ = chain
    publish_all(S.open_store(tmp_path), ckpts, 3)
    (f,) = (tmp_path / "v000002").glob("*/delta.zst")
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    store = S.open_store(tmp_path)
    assert D.tensor_hashes(store.materialize(1)) == D.tensor_hashes(ckpts[1])
    with pytest.raises(D.DeltaError, match=f"{f.parent.name}/delta.zst does not match .* \\(corrupt object\\)"):
        store.materialize(2)
    assert store.corrupt == 1
    (m,) = (tmp_path / "v000001").glob("*/manifest.json")
    m.write_text("{}")
    with pytest.raises(D.DeltaError, match="STABLE"):
        S.open_store(tmp_path).manifest(1)
    (tmp_path / "v000000" / "STABLE").write_text("abc ../../etc/passwd\n")  # a marker naming a path outside
    with pytest.raises(D.DeltaError, match="not a file name"):
        S.open_store(tmp_path).manifest(0)


def test_verify_reads_a_version_back_from_storage_and_trusts_nothing_in_memory(tmp_path, chain):
    """A payload damaged after STABLE passes `materialize` in the process that holds the version in
    memory, and fails `verify` there; the versions around it still verify."""
    ckpts, _, _ = chain
    store = S.open_store(tmp_path, full_every=100)
    publish_all(store, ckpts, 4)
    for v in range(4):
        store.verify(v)
    (f,) = (tmp_path / "v000003").glob("*/delta.zst")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert D.tensor_hashes(store.materialize(3)) == D.tensor_hashes(ckpts[3])  # the publisher's cached copy
    with pytest.raises(D.DeltaError, match="does not match the sha256 in its manifest"):
        store.verify(3)
    for v in range(3):
        store.verify(v)
    (tmp_path / "v000001" / "STABLE").unlink()
    with pytest.raises(S.StoreError, match="not in the store"):
        store.verify(1)
    with pytest.raises(S.StoreError):  # its chain needs v1's delta
        S.open_store(tmp_path).verify(2)


def test_publishing_says_who_holds_the_publish_lock(tmp_path, chain):
    """The probe sees a writer in another process (flock), names it, and never blocks it."""
    store = S.open_store(tmp_path)
    assert store.publishing() is None
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from learner import store as S; s = S.open_store(sys.argv[1])\n"
            "with s._writer():\n    print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.publishing() == f"pid {holder.pid} on {__import__('socket').gethostname()}"
    finally:
        holder.kill()
        holder.wait(timeout=scaled(30))
    assert store.publishing() is None  # the kernel released it with its holder
    publish_all(store, chain[0], 1)  # and the probe left it free for a writer


def test_cleanup_keeps_what_the_kept_versions_need(tmp_path, chain):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path, full_every=3)
    publish_all(store, ckpts)
    assert store.cleanup(keep=2) == [0, 1, 2]  # 4 and 5 need the snapshot 3
    assert store.versions() == [3, 4, 5]
    assert D.tensor_hashes(S.open_store(tmp_path).materialize(5)) == D.tensor_hashes(ckpts[5])
    assert store.cleanup(keep=1) == []  # 5 still needs 3 and 4


def test_packed_forms_agree_with_the_export(tmp_path, chain):
    ckpts, model, args = chain
    packed = S.pack_checkpoint(model.state_dict())
    assert D.tensor_hashes(packed) == D.tensor_hashes(ckpts[5])
    # what serving loads: the bf16 tensors export_hf writes
    hf = S.to_hf_tensors(packed)
    ref = checkpoint_tensors(model, weight_fn=fp4_dequantized("nvfp4"))
    assert hf.keys() == ref.keys() and all(torch.equal(hf[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in ref)
    # the pretrained base's packed artifact reads back as the same packed checkpoint
    export_packed_fp4(model, args, tmp_path / "fp4", fmt="nvfp4")
    assert D.tensor_hashes(S.load_packed_artifact(tmp_path / "fp4")) == D.tensor_hashes(packed)
    # and a full snapshot in the store is that layout
    store = S.open_store(tmp_path / "store")
    store.publish(packed, parent=None)
    assert D.tensor_hashes(S.open_store(tmp_path / "store").materialize(0)) == D.tensor_hashes(packed)


def test_announce_and_record(tmp_path, chain):
    ckpts, _, _ = chain
    store = S.open_store(tmp_path / "w")
    msgs = publish_all(store, ckpts, 2)

    class Sink:
        sent = []

        def send(self, topic, msg):
            self.sent.append((topic, msg))

    assert S.announce(msgs[1], Sink()) is msgs[1] and Sink.sent == [(bus.VERSIONS, msgs[1])]
    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    for m in msgs:
        S.record(m, engine)
    S.record(store.model_version(1, gate_passed=False, gate_reason="kl spike", metrics={"kl": 0.3}), engine)
    with engine.connect() as conn:
        rows = conn.execute(db.model_versions.select().order_by(db.model_versions.c.version)).mappings().all()
    assert [(r["version"], r["kind"], r["parent"]) for r in rows] == [(0, "full", None), (1, "delta", 0)]
    assert (rows[1]["gate_passed"], rows[1]["gate_reason"], rows[1]["metrics"]) == (False, "kl spike", {"kl": 0.3})
    assert rows[1]["sha256"] == msgs[1].sha256 and rows[1]["size_bytes"] == msgs[1].size_bytes


def test_unknown_schemes_and_decreasing_versions_are_refused(tmp_path, chain):
    ckpts, _, _ = chain
    with pytest.raises(ValueError, match="the scheme must be file://, s3:// or gs://"):
        S.open_store("ftp://host/weights")
    with pytest.raises(ValueError, match="names no bucket"):
        S.open_store("s3://")
    if importlib.util.find_spec("gcsfs") is None:  # the optional extra
        with pytest.raises(ValueError, match=r"gs:// stores need gcsfs \(pip install 'flywheel-rl\[gcs\]'\)"):
            S.open_store("gs://bucket/weights")
    store = S.open_store(tmp_path)
    publish_all(store, ckpts, 2)
    with pytest.raises(S.StoreError, match="already in the store"):
        store.publish(ckpts[2], parent=1, version=1)
    with pytest.raises(S.StoreError, match="parent 7"):
        store.publish(ckpts[2], parent=7)
    # a changed layout goes out as a full snapshot
    bigger = {**ckpts[2], "extra.weight": torch.zeros(4, dtype=torch.bfloat16)}
    m = store.publish(bigger, parent=1)
    assert m.kind == "full" and store.manifest(m.version)["full_reason"] == "the tensor layout changed"


# --- two publishers on one store -------------------------------------------------------------------


def test_two_publishers_racing_for_one_version_one_wins_and_the_loser_removes_nothing(tmp_path, chain, monkeypatch):
    """Two learners (each with its own Store, as in two processes) publish v2 at the same moment;
    slow writes hold the window between the version check and STABLE open for a second."""
    ckpts, _, _ = chain
    publish_all(S.open_store(tmp_path), ckpts, 2)
    real = S._write_synced

    def slow(path, data):
        time.sleep(0.25)
        real(path, data)

    monkeypatch.setattr(S, "_write_synced", slow)
    results: dict[int, object] = {}

    def publish(which: int) -> None:
        try:
            results[which] = S.open_store(tmp_path).publish(ckpts[which], parent=1, version=2)
        except Exception as e:  # the loser's error, whatever it is
            results[which] = e

    threads = [threading.Thread(target=publish, args=(w,)) for w in (2, 3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    won = [w for w, r in results.items() if isinstance(r, ModelVersion)]
    lost = [r for r in results.values() if not isinstance(r, ModelVersion)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], S.StoreError) and "already in the store" in str(lost[0])
    reader = S.open_store(tmp_path)
    assert reader.versions() == [0, 1, 2] and results[won[0]].sha256 == reader.model_version(2).sha256
    assert D.tensor_hashes(reader.materialize(2)) == D.tensor_hashes(ckpts[won[0]])  # the winner's, verified
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert reader.unfinished() == {}  # the loser removed its own attempt folder, nothing else


RACER = """
import json, sys, time
import torch
from learner import delta as D
from learner import store as S

root, role, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = S.open_store(root)
won, lost = [], []
for v in range(1, last + 1):
    g = torch.Generator().manual_seed(2 * v + (role == "b"))
    ckpt = {"w": torch.randn(512, 512, generator=g).to(torch.bfloat16), "b": torch.full((8,), float(v))}
    while v - 1 not in store.versions():
        time.sleep(0.01)
    try:
        store.publish(ckpt, parent=v - 1, version=v)
        won.append([v, D.checkpoint_digest(D.tensor_hashes(ckpt))])
    except S.StoreError as e:
        lost.append([v, str(e)])
print(json.dumps({"won": won, "lost": lost}))
"""


def test_two_learner_processes_never_publish_the_same_version(tmp_path):
    """Two processes race for each of versions 1..8: every version has exactly one author, and
    the store holds exactly what that author wrote."""
    store = S.open_store(tmp_path / "w")
    store.publish({"w": torch.zeros(512, 512, dtype=torch.bfloat16), "b": torch.zeros(8)}, parent=None)
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "w"), role, "8"], stdout=subprocess.PIPE, env=env)
        for role in ("a", "b")
    ]
    outs = [p.communicate(timeout=scaled(300))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    results = [json.loads(out) for out in outs]
    wins = [v for r in results for v, _ in r["won"]]
    assert sorted(wins) == list(range(1, 9)), results  # each version once, by one of them
    assert all("already in the store" in why for r in results for _, why in r["lost"])
    reader = S.open_store(tmp_path / "w")
    for r in results:
        for v, digest in r["won"]:
            assert reader.manifest(v)["digest"] == digest
    assert reader.materialize(8)["b"][0].item() == 8.0  # the whole chain verifies


def test_the_store_is_created_owner_only(tmp_path, chain):
    ckpts, _, _ = chain
    old = os.umask(0o022)
    try:
        publish_all(S.open_store(tmp_path / "data" / "weights"), ckpts, 2)
    finally:
        os.umask(old)
    paths = [tmp_path / "data", *(tmp_path / "data").rglob("*")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in paths if p.is_dir()} == {0o700}
    files = [p for p in paths if p.is_file()]
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600} and len(files) == 6 + 1  # + the lock


def test_a_version_carries_its_show_policy_in_its_manifest(tmp_path, chain):
    """learner/show.py: published with the version, read back by every reader of the store; a
    policy this code cannot apply is a StoreError (one line), not a crash in serving."""
    from tests.helpers import logprob_policy

    ckpts, _, _ = chain
    policy = logprob_policy(weights=(1.0, 0, 0, 0, 0), bias=0.5, samples=80, accepts=20)
    store = S.open_store(tmp_path)
    store.publish(ckpts[0], parent=None)
    store.publish(ckpts[1], parent=0, show_policy=policy.as_dict())
    store.publish(ckpts[2], parent=1, show_policy={"bias": 1.0})
    reader = S.open_store(tmp_path)
    assert reader.show_policy(0) is None and reader.show_policy(1) == policy
    with pytest.raises(S.StoreError, match="version 2: its show policy cannot be applied: not a show policy"):
        reader.show_policy(2)
