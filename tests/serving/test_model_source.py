"""Serving starts from the weight store's version, never from an unrelated folder."""

import pytest

from feedback import db
from feedback.core.errors import UserError
from learner import store as S
from learner.base import ensure_imported
from learner.base_settings import ModelSection
from serving.model_source import store_model_folder
from serving.settings import ServingSettings
from tests.learner.family_models import make_family_model
from tests.learner.train.learn_support import ListProducer


def settings(tmp_path, **serve) -> ServingSettings:
    return ServingSettings(data_dir=tmp_path / "data", serve=serve)


def test_the_store_decides_what_replicas_load(tmp_path):
    a = make_family_model(tmp_path / "a", "qwen3")
    b = make_family_model(tmp_path / "b", "qwen3", seed=1)
    s = settings(tmp_path)
    assert store_model_folder(s) is None  # empty store: the caller serves the pretrained base as before
    with pytest.raises(UserError, match="holds no imported model: run `flywheel base import"):
        store_model_folder(s.model_copy(update={"model": ModelSection(base=a)}))

    store = S.open_store(S.default_store_uri(s))
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    ensure_imported(ModelSection(base=a), store, engine=engine, producer=ListProducer(), replicas=1)
    folder = store_model_folder(s)
    assert folder == tmp_path / "data" / "served" / "v000000" and (folder / "model.safetensors").is_file()
    assert (folder / "config.json").read_bytes() == (a / "config.json").read_bytes()

    with pytest.raises(UserError, match=f"serve.model_dir {b} is not v0 of the weight store"):
        store_model_folder(settings(tmp_path, model_dir=str(b)))  # another model's folder: refused
    assert store_model_folder(settings(tmp_path, model_dir=str(folder))) == folder  # v0 itself: fine
    with pytest.raises(UserError, match="holds imported"):
        store_model_folder(s.model_copy(update={"model": ModelSection(base=b)}))
    with pytest.raises(UserError, match="serve.model_version 3 is not in the weight store"):
        store_model_folder(settings(tmp_path, model_version=3))


def test_a_replica_keeps_its_files_in_its_own_nodes_folder(tmp_path):
    """`flywheel serve` exported v0 where it ran; a replica on another node exports it again into
    that node's own serve.replica_dir (from the node's environment) and caches payloads there."""
    from serving.model_source import REPLICA_DIR_ENV, node_settings, replica_model_folder, served_folder

    a = make_family_model(tmp_path / "a", "qwen3")
    s = settings(tmp_path)
    store = S.open_store(S.default_store_uri(s))
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    ensure_imported(ModelSection(base=a), store, engine=engine, producer=ListProducer(), replicas=1)
    exported = store_model_folder(s)  # where `flywheel serve` ran

    assert node_settings(s, {}) is s  # no replica_dir anywhere: the configured folders, as before
    assert replica_model_folder(s, store, 0, exported, node_settings(s, {})) == exported

    node = node_settings(s, {REPLICA_DIR_ENV: str(tmp_path / "node-b")})
    assert node.serve.replica_dir == tmp_path / "node-b" and node.store_cache_dir == tmp_path / "node-b" / "store"
    assert node.database_url == s.database_url  # only the node's own folders move, not the shared state
    folder = replica_model_folder(s, store, 0, exported, node)
    assert folder == served_folder(node, 0) == tmp_path / "node-b" / "served" / "v000000"
    assert (folder / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()

    configured = settings(tmp_path, replica_dir=str(tmp_path / "configured"))
    assert node_settings(configured, {}).store_cache_dir == tmp_path / "configured" / "store"
    assert node_settings(configured, {REPLICA_DIR_ENV: str(tmp_path / "env")}).serve.replica_dir == tmp_path / "env"
    other = tmp_path / "operator-folder"  # serve.model_dir, the cached base: the operator's, used as given
    assert replica_model_folder(s, store, 0, other, node) == other
