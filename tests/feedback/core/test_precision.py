"""The compute dtype: bf16 only where the hardware runs it fast, float32 elsewhere; overrides win."""

import pytest

from feedback.core import precision as P


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(P.ENV_OVERRIDE, raising=False)
    forget()
    yield
    forget()


def forget() -> None:
    P._cpu_probe.cache_clear()
    P._cpu_choice.cache_clear()


def probe(monkeypatch, fp32: float, bf16: float) -> None:
    monkeypatch.setattr(P, "measure_matmul", lambda: {"capability": "AVX2", "float32": fp32, "bfloat16": bf16})


def test_an_avx2_only_cpu_computes_in_float32_and_says_why(monkeypatch):
    probe(monkeypatch, fp32=89.0, bf16=1.2)  # the AMD EPYC of the fresh-machine report
    got = P.resolve("auto")
    assert got.dtype == "float32" and got.short == "fp32"
    assert "bf16 matmul 1.2 GFLOP/s vs fp32 89.0" in got.reason and "AVX2" in got.reason


def test_a_cpu_with_fast_bf16_computes_in_bf16(monkeypatch):
    probe(monkeypatch, fp32=80.0, bf16=160.0)
    assert P.resolve("auto").dtype == "bfloat16"


def test_bf16_up_to_twice_as_slow_still_counts_as_fast(monkeypatch):
    probe(monkeypatch, fp32=100.0, bf16=100.0 / P._SLOWER_OK)
    assert P.resolve("auto").dtype == "bfloat16"
    forget()
    probe(monkeypatch, fp32=100.0, bf16=100.0 / P._SLOWER_OK - 1)
    assert P.resolve("auto").dtype == "float32"


def test_a_setting_or_the_environment_overrides_the_probe(monkeypatch):
    probe(monkeypatch, fp32=89.0, bf16=1.2)
    got = P.resolve("bf16", setting="pretrain.precision")
    assert got.dtype == "bfloat16" and got.reason == "set by pretrain.precision"
    monkeypatch.setenv(P.ENV_OVERRIDE, "fp32")
    probe(monkeypatch, fp32=80.0, bf16=160.0)
    assert P.resolve("auto") == P.Precision("float32", f"set by {P.ENV_OVERRIDE}")
    assert P.resolve("bfloat16").dtype == "bfloat16"  # an explicit setting beats the environment


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="use auto, bfloat16 \\(bf16\\), float32 \\(fp32\\) or float16"):
        P.normalize("int8")
    assert [P.normalize(n) for n in ("BF16", " fp32 ", "float16", "auto")] == ["bfloat16", "float32", "float16", "auto"]


def test_the_cpu_flags_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert P.cpu_bf16_flags(info) == ["avx512_bf16", "amx_bf16"]
    info.write_text("flags\t\t: fpu avx2\n")
    assert P.cpu_bf16_flags(info) == []
    assert P.cpu_bf16_flags(tmp_path / "missing") == []


def test_the_probe_measures_both_dtypes_here():
    got = P.measure_matmul(n=64, seconds=0.005)
    assert got["float32"] > 0 and got["bfloat16"] > 0 and got["capability"]


def test_training_asks_for_bf16_only_where_it_is_not_slower(monkeypatch):
    # An AVX-512 BF16 CPU without AMX: bf16 matmul 1.9x slower. Serving keeps bf16; a
    # compute-bound training step runs faster in fp32 there.
    probe(monkeypatch, fp32=166.0, bf16=86.3)
    assert P.resolve("auto").dtype == "bfloat16"
    got = P.resolve("auto", slower_ok=P.TRAINING_SLOWER_OK)
    assert got.dtype == "float32" and "at most 1x slower" in got.reason
    probe(monkeypatch, fp32=80.0, bf16=80.0)  # as fast: bf16 (half the memory traffic)
    forget()
    assert P.resolve("auto", slower_ok=P.TRAINING_SLOWER_OK).dtype == "bfloat16"


def test_pretraining_resolves_auto_with_the_training_bound(monkeypatch):
    import torch

    from learner.train.pretrain import _autocast

    probe(monkeypatch, fp32=166.0, bf16=86.3)
    with _autocast(torch.device("cpu"), "auto"):
        assert not torch.is_autocast_enabled("cpu")  # fp32
    probe(monkeypatch, fp32=80.0, bf16=160.0)
    forget()
    with _autocast(torch.device("cpu"), "auto"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
