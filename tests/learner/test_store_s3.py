"""The weight store on a real S3 server (SeaweedFS, which the test session builds and starts:
tests/s3_server.py): publish, fetch and verify through a reader's own cache; a publisher killed
between its payload and its manifest; a corrupt object; two publishers for one version; the
connection from settings and from the standard AWS environment."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from feedback.core.config import StackSettings
from feedback.schemas import ModelVersion
from learner import delta as D
from learner import store as S
from tests.helpers import scaled
from tests.learner.test_store import chain, publish_all  # noqa: F401  (chain: a module fixture)


def s3_store(server, uri: str, **opts) -> S.Store:
    return S.open_store(uri, storage_options=server.storage_options(), **opts)


def keys(store: S.Store, version: int) -> tuple[str, set[str]]:
    """(the attempt STABLE names, every key under the version's folder relative to it)."""
    folder = f"{store.root}/v{version:06d}"
    attempt = store.fs.cat_file(f"{folder}/STABLE").decode().split()[1].split("/")[0]
    return attempt, {k[len(folder) + 1 :] for k in store.fs.find(folder)}


def test_publish_fetch_and_verify_on_s3(s3_server, s3_uri, chain, tmp_path):  # noqa: F811
    ckpts, _, _ = chain
    store = s3_store(s3_server, s3_uri, full_every=3)
    msgs = publish_all(store, ckpts)
    assert store._conditional is True  # the server honours If-None-Match: each STABLE is a conditional create
    assert [m.kind for m in msgs] == ["full", "delta", "delta", "full", "delta", "delta"]
    assert msgs[1].uri == f"{s3_uri}/v000001" and msgs[1].size_bytes * 4 < msgs[1].full_size_bytes
    for v in range(6):
        attempt, found = keys(store, v)
        payloads = {"full.safetensors"} if v == 0 else {"delta.zst", "full.safetensors"} if v == 3 else {"delta.zst"}
        assert found == {"STABLE", f"{attempt}/manifest.json", *(f"{attempt}/{p}" for p in payloads)}
    # a cold reader (another machine): from the nearest snapshot, through its own cache
    cache = tmp_path / "cache"
    reader = s3_store(s3_server, s3_uri, cache_dir=cache)
    assert reader.versions() == list(range(6)) and reader.plan(5).full == 3
    for v in (5, 1, 4):
        assert D.tensor_hashes(reader.materialize(v)) == D.tensor_hashes(ckpts[v])
    for v in range(6):
        reader.verify(v)
    payloads = {info["sha256"]: info["size"] for v in range(6) for info in reader.manifest(v)["files"].values()}
    cached = {p.name: p.stat().st_size for p in cache.iterdir()}
    assert cached and all(payloads[sha] == size for sha, size in cached.items())
    # the cache serves a later reader even when the object is gone from the store ...
    attempt, _ = keys(store, 5)
    store.fs.rm_file(f"{store.root}/v000005/{attempt}/delta.zst")
    again = s3_store(s3_server, s3_uri, cache_dir=cache)
    assert D.tensor_hashes(again.materialize(5)) == D.tensor_hashes(ckpts[5])
    # ... and `verify` reads the store itself, not the cache
    with pytest.raises(S.StoreError, match="delta.zst is missing"):
        again.verify(5)


KILLED_MID_PUBLISH = """
import os, signal, sys
from learner import store as S

uri, endpoint, key, secret = sys.argv[1:5]
store = S.open_store(uri, storage_options={"endpoint_url": endpoint, "key": key, "secret": secret})
packed = dict(store.materialize(1))
packed["model.norm.weight"] = packed["model.norm.weight"] * 1.0078125
real = store.fs.pipe_file

def pipe_file(path, data, **kwargs):
    real(path, data, **kwargs)
    print("wrote", path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies after its first payload, before its manifest and STABLE

store.fs.pipe_file = pipe_file
store.publish(packed, parent=1)
"""


def test_a_publisher_killed_mid_publish_leaves_no_visible_version(s3_server, s3_uri, chain, tmp_path):  # noqa: F811
    ckpts, _, _ = chain
    store = s3_store(s3_server, s3_uri)
    publish_all(store, ckpts, 2)
    s = s3_server
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_PUBLISH, s3_uri, s.endpoint, s.access_key, s.secret_key],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    (attempt_file,) = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    attempt = attempt_file.split("/")[0]
    reader = s3_store(s3_server, s3_uri)
    assert reader.versions() == [0, 1] and reader.latest() == 1  # nothing visible
    with pytest.raises(S.StoreError, match="not in the store"):
        reader.materialize(2)
    left = reader.unfinished()
    assert list(left) == [f"v000002/{attempt}"] and left[f"v000002/{attempt}"] < scaled(300)
    # no lock on S3: a cleanup keeps uncommitted objects younger than debris_age_s (a publish may be writing)
    assert reader.cleanup(keep=10) == [] and list(reader.unfinished()) == [f"v000002/{attempt}"]
    # the next publish of that number goes through, beside the leftover
    assert store.publish(ckpts[2], parent=1).version == 2
    assert D.tensor_hashes(s3_store(s3_server, s3_uri).materialize(2)) == D.tensor_hashes(ckpts[2])
    # and once old enough, the leftover is removed, nothing else
    assert s3_store(s3_server, s3_uri, debris_age_s=0.0).cleanup(keep=10) == []
    assert reader.unfinished() == {} and reader.versions() == [0, 1, 2]
    assert keys(reader, 2)[1] == {"STABLE", *(f"{keys(reader, 2)[0]}/{n}" for n in ("delta.zst", "manifest.json"))}


def test_a_corrupt_object_is_refused_named_and_counted(s3_server, s3_uri, chain, tmp_path):  # noqa: F811
    ckpts, _, _ = chain
    store = s3_store(s3_server, s3_uri)
    publish_all(store, ckpts, 3)
    attempt, _ = keys(store, 2)
    path = f"{store.root}/v000002/{attempt}/delta.zst"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    reader = s3_store(s3_server, s3_uri, cache_dir=tmp_path / "cache")
    assert D.tensor_hashes(reader.materialize(1)) == D.tensor_hashes(ckpts[1])
    with pytest.raises(D.DeltaError, match=rf"{s3_uri}/v000002/{attempt}/delta.zst does not match .*corrupt object"):
        reader.materialize(2)
    assert reader.corrupt == 1 and D.tensor_hashes(reader.materialize(1)) == D.tensor_hashes(ckpts[1])
    assert {p.name for p in (tmp_path / "cache").iterdir()} == {  # the bad bytes were never kept
        reader.manifest(v)["files"][k]["sha256"] for v, k in ((0, "full"), (1, "delta"))
    }
    # a damaged manifest is refused against STABLE's sha256
    m_attempt, _ = keys(store, 1)
    store.fs.pipe_file(f"{store.root}/v000001/{m_attempt}/manifest.json", b"{}")
    with pytest.raises(D.DeltaError, match=rf"v000001/{m_attempt}/manifest.json sha256 .* STABLE marker"):
        s3_store(s3_server, s3_uri).manifest(1)
    # a damaged cache entry is fetched again, from the (intact) store
    (tmp_path / "cache" / reader.manifest(0)["files"]["full"]["sha256"]).write_bytes(b"damaged")
    assert D.tensor_hashes(s3_store(s3_server, s3_uri, cache_dir=tmp_path / "cache").materialize(0)) == (
        D.tensor_hashes(ckpts[0])
    )


def test_two_publishers_for_one_version_one_loses_cleanly(s3_server, s3_uri, chain, monkeypatch):  # noqa: F811
    """Two learners (two Store objects, as in two processes) publish v2 at once; both have written
    their payloads and manifests before either creates STABLE, so only the conditional create decides."""
    ckpts, _, _ = chain
    publish_all(s3_store(s3_server, s3_uri), ckpts, 2)
    both_written = threading.Barrier(2, timeout=scaled(120))
    real = S.Store._create

    def create(self, path, data):
        both_written.wait()
        real(self, path, data)

    monkeypatch.setattr(S.Store, "_create", create)
    results: dict[int, object] = {}

    def publish(which: int) -> None:
        try:
            results[which] = s3_store(s3_server, s3_uri).publish(ckpts[which], parent=1, version=2)
        except Exception as e:  # the loser's error, whatever it is
            results[which] = e

    threads = [threading.Thread(target=publish, args=(w,)) for w in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=scaled(300))
    won = [w for w, r in results.items() if isinstance(r, ModelVersion)]
    lost = [r for r in results.values() if not isinstance(r, ModelVersion)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(lost[0], S.StoreError) and "already in the store" in str(lost[0])
    monkeypatch.undo()
    reader = s3_store(s3_server, s3_uri)
    assert reader.versions() == [0, 1, 2] and results[won[0]].sha256 == reader.model_version(2).sha256
    assert D.tensor_hashes(reader.materialize(2)) == D.tensor_hashes(ckpts[won[0]])  # the winner's, verified
    assert reader.unfinished() == {}  # the loser removed its own attempt, and only that


def test_the_connection_comes_from_settings_or_the_aws_environment(s3_server, s3_uri, chain, tmp_path, monkeypatch):  # noqa: F811
    ckpts, _, _ = chain
    s = s3_server
    settings = StackSettings(
        data_dir=tmp_path / "data",
        cache_dir=tmp_path / "cache",
        store={
            "uri": s3_uri,
            "s3": {"endpoint_url": s.endpoint, "access_key_id": s.access_key, "secret_access_key": s.secret_key},
        },
    )
    store = S.settings_store(settings, full_every=4)
    assert store.publish(ckpts[0], parent=None).uri == f"{s3_uri}/v000000" and store.full_every == 4
    assert store.cache is not None and store.cache.folder == tmp_path / "cache" / "store"
    dump = json.dumps(settings.redacted())
    assert s.secret_key not in dump and s.access_key in dump and s3_uri in dump
    assert not (tmp_path / "data" / "weights").exists()  # nothing local
    # the standard AWS environment, when the settings leave the connection out
    for name, value in (
        ("AWS_ENDPOINT_URL", s.endpoint),
        ("AWS_ACCESS_KEY_ID", s.access_key),
        ("AWS_SECRET_ACCESS_KEY", s.secret_key),
        ("AWS_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(name, value)
    bare = StackSettings(data_dir=tmp_path / "data", store={"uri": s3_uri})
    assert S.settings_store(bare).versions() == [0]
    # a wrong secret is refused with one clear line, not a traceback from the S3 client
    wrong = StackSettings(store={"uri": s3_uri, "s3": {"access_key_id": s.access_key, "secret_access_key": "nope"}})
    with pytest.raises(S.StoreError, match="refused access .*check the store.s3 credentials"):
        S.settings_store(wrong).versions()
    with pytest.raises(Exception, match="store.uri 'ftp://x/y': the scheme must be one of file, s3, gs, gcs"):
        StackSettings.load(None, ["store.uri=ftp://x/y"])


def test_where_a_server_ignores_if_none_match_the_commit_checks_and_reads_back(s3_server, s3_uri, chain):  # noqa: F811
    """The fallback for servers found not to honour If-None-Match (here forced on a server that
    does): a STABLE that exists is never overwritten, and a publish that finds it taken fails."""
    ckpts, _, _ = chain
    first = s3_store(s3_server, s3_uri)
    first._conditional = False
    first.publish(ckpts[0], parent=None)
    second = s3_store(s3_server, s3_uri)
    second._conditional = False
    sha = first.model_version(0).sha256
    with pytest.raises(FileExistsError):
        second._create(f"{second.root}/v000000/STABLE", b"another commit\n")
    assert s3_store(s3_server, s3_uri).model_version(0).sha256 == sha  # untouched
    assert second.publish(ckpts[1], parent=0).version == 1 and second.unfinished() == {}
