"""`flywheel base import`: a Hugging Face folder becomes v0 of the weight store, or is refused with
one line saying why."""

import json
import shutil

import pytest
import torch

from feedback import db
from learner import store as S
from learner.base import LEARNER_BYTES_PER_PARAM, check_base, check_memory, ensure_imported, memory_estimate
from learner.base_settings import ModelSection
from learner.export import load_hf
from tests.helpers import flywheel
from tests.learner.family_models import make_family_model
from tests.learner.train.learn_support import ListProducer
from tests.ops.cli.test_main import assert_one_line_error


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", chat_eos=True)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


def imported(tmp_path, folder, **model):
    store = S.open_store(tmp_path / "weights")
    engine = db.make_engine(f"sqlite:///{tmp_path / 'fw.db'}")
    db.upgrade(engine)
    producer = ListProducer()
    base, published = ensure_imported(
        ModelSection(base=folder, **model), store, engine=engine, producer=producer, replicas=2
    )
    return store, engine, producer, base, published


def test_an_moe_is_imported_as_v0_with_its_experts_in_fp4(tmp_path, moe_folder):
    store, engine, producer, base, published = imported(tmp_path, moe_folder)
    assert published and store.versions() == [0] and [m.version for _, m in producer.sent] == [0]
    m = store.manifest(0)
    assert m["kind"] == "full" and m["parent"] is None
    kinds = {n: t["kind"] for n, t in m["tensors"].items()}
    assert {n for n, k in kinds.items() if k == "fp4"} == {n for n in kinds if ".mlp.experts." in n}  # the experts only
    assert base["architecture"] == "Qwen2MoeForCausalLM" and base["kind"] == "imported" and base["fim"] == "qwen"
    assert base["source"] == str(moe_folder) and base["start_version"] == 0
    files = store.model_files()
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "base.json"} <= set(
        files
    )
    assert files["config.json"] == (moe_folder / "config.json").read_bytes()  # vLLM loads the model's own config
    with engine.connect() as conn:
        row = conn.execute(db.model_versions.select()).one()
    assert row.version == 0 and row.gate_passed and "imported base" in row.gate_reason

    # the served folder: the store's model files and v0's bf16 tensors; FP4 targets on the grid
    served = S.export_version(store, 0, tmp_path / "served")
    model, args = load_hf(served)
    original, _ = load_hf(moe_folder)
    for name, t in model.state_dict().items():
        if kinds[name] == "dense":
            assert torch.equal(t, original.state_dict()[name].to(torch.bfloat16).float()), name
    assert S.export_version(store, 0, tmp_path / "served") == served  # kept: it still holds v0

    again = ensure_imported(ModelSection(base=moe_folder), store, engine=engine, producer=producer, replicas=2)
    assert again == (base, False) and store.versions() == [0]  # importing it again changes nothing


def test_a_dense_model_keeps_every_tensor_in_bf16_unless_targets_are_named(tmp_path, dense_folder):
    store, *_ = imported(tmp_path / "a", dense_folder)
    assert {t["kind"] for t in store.manifest(0)["tensors"].values()} == {"dense"}
    assert "lm_head.weight" not in store.manifest(0)["tensors"]  # tied: the embedding is the output layer
    store, *_, base, _ = imported(tmp_path / "b", dense_folder, fp4_targets=[r"\.mlp\.(gate|up|down)_proj\.weight$"])
    fp4 = [n for n, t in store.manifest(0)["tensors"].items() if t["kind"] == "fp4"]
    assert len(fp4) == 6 and base["fp4_targets"] == [r"\.mlp\.(gate|up|down)_proj\.weight$"]


def test_a_store_that_holds_another_model_is_refused(tmp_path, moe_folder, dense_folder):
    store, engine, producer, *_ = imported(tmp_path, moe_folder)
    with pytest.raises(ValueError, match="holds imported .* use a fresh data_dir"):
        ensure_imported(ModelSection(base=dense_folder), store, engine=engine, producer=producer, replicas=2)


def test_the_memory_estimate_and_its_refusal(moe_folder):
    info = check_base(moe_folder)
    need = memory_estimate(info.parameters, replicas=2)
    assert need["learner"] == LEARNER_BYTES_PER_PARAM * info.parameters and need["replicas"] == 4 * info.parameters
    assert check_memory(info, replicas=2, available=need["total"]) == need
    with pytest.raises(ValueError, match=r"needs about .* GiB \(learner .* more than the .* GiB here"):
        check_memory(info, replicas=2, available=need["total"] - 1)
    # Qwen2.5-Coder-1.5B's size, for the README's numbers: 28 bytes a parameter
    assert memory_estimate(1_543_714_304, 2)["total"] / 2**30 == pytest.approx(46.0, abs=0.1)


# --- the refusals, as a user meets them: one line and a non-zero exit ------------------------------


def refused(tmp_path, folder, fragment, *extra):
    r = flywheel("base", "import", str(folder), *extra, tmp_path=tmp_path)
    assert_one_line_error(r, fragment)
    assert not (tmp_path / "data" / "weights" / "v000000").exists()  # nothing published


def test_refuses_an_unsupported_architecture(tmp_path, moe_folder):
    folder = tmp_path / "llama"
    shutil.copytree(moe_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    refused(
        tmp_path,
        folder,
        "architecture LlamaForCausalLM is not supported; supported: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
        "Qwen3ForCausalLM, Qwen2ForCausalLM",
    )


def test_refuses_a_folder_without_tokenizer(tmp_path, moe_folder):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(moe_folder, folder)
    (folder / "tokenizer.json").unlink()
    refused(tmp_path, folder, "has no tokenizer.json")


def test_refuses_missing_shards(tmp_path, moe_folder):
    folder = tmp_path / "sharded"
    shutil.copytree(moe_folder, folder)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    (folder / "model.safetensors").unlink()
    weight_map = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused(tmp_path, folder, "1 of the 2 shards model.safetensors.index.json names are missing (model-00002-of-00002")


def test_refuses_a_model_larger_than_the_memory(tmp_path, moe_folder):
    refused(tmp_path, moe_folder, "GiB here: use a machine with more memory", "--set", "model.memory_gib=0.0001")


def test_refuses_a_folder_that_is_no_model_or_already_quantized(tmp_path, moe_folder):
    refused(tmp_path, tmp_path, "is not a Hugging Face model folder: it has no config.json")
    folder = tmp_path / "fp8"
    shutil.copytree(moe_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    refused(tmp_path, folder, "is already quantized (fp8): import the bf16 checkpoint")
