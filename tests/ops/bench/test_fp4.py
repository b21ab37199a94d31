import json

import pytest
import torch

from learner.model import ModelArgs, Transformer
from ops.bench.fp4 import quant_error, replay_kl
from ops.cli.console import bench_subcommands
from ops.cli.learner import cmd_bench_fp4
from ops.cli.main import build_parser
from tests.helpers import flywheel


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_replaying_high_precision_routing_lowers_the_fp4_kl(fmt):
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("tiny", vocab_size=300)).eval()
    model.init_weights(std=0.1)  # weights of a trained model's scale: at 0.02 the experts barely matter
    ids = torch.randint(0, 300, (4, 48), generator=torch.Generator().manual_seed(1))
    r = replay_kl(model, ids, fmt)
    assert r["routing_flip_fraction_per_layer"][0] == 0  # nothing FP4 comes before the first router
    assert r["routing_flip_fraction"] > 0.01  # FP4 noise flips expert choices later on ...
    assert 0 < r["kl_replay"] < 0.95 * r["kl_no_replay"]  # ... and replay removes their share of the error


def test_nvfp4_error_is_lower_than_mxfp4_on_gaussian_data():
    x = [torch.randn(64, 512, generator=torch.Generator().manual_seed(0))]
    nv, mx = quant_error(x, "nvfp4"), quant_error(x, "mxfp4")
    assert nv["rel_mse"] < mx["rel_mse"] and nv["snr_db"] > mx["snr_db"] > 10


def test_bench_parser_is_shared():
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    assert bench_subcommands(sub) is bench_subcommands(sub)  # created once, found again by other packages
    args = p.parse_args(["bench", "fp4", "--steps", "3", "--out", "r.json"])
    assert args.fn is cmd_bench_fp4 and args.steps == 3


@pytest.mark.slow
def test_bench_fp4_command_writes_json(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"m{i}.py").write_text(
            f"import os\n\n\ndef f{i}(x, y={i}):\n    return os.path.join(x, str(y))\n" * 40
        )
    out = tmp_path / "r.json"
    r = flywheel(
        "bench",
        "fp4",
        "--steps",
        "4",
        "--out",
        str(out),
        "--set",
        f"pretrain.corpus={json.dumps(str(corpus))}",
        "--set",
        "pretrain.vocab_size=400",
        "--set",
        f"cache_dir={tmp_path / 'cache'}",
        tmp_path=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["command"].startswith("flywheel bench fp4") and "random tiny model" in res["weights"]
    assert set(res) >= {"quant_error", "throughput", "qat_vs_bf16", "router_replay"}
    assert "flywheel bench fp4" in r.stdout
