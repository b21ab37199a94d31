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
