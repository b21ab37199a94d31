"""The prepared reload (serving/reload.py) on a small module tree shaped like a vLLM model: loaders
bound to their layer, vLLM's recorded checkpoint form, a processing step that changes the layout.
With vLLM's engine: tests/serving/test_hotswap.py (test_vllm_hot_swap_serves_the_new_weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from serving.reload import Preparation, Unsupported, prepare


class UnquantizedTransposing(QuantizeMethodBase):
    """Processing as a CPU linear layer's: the kernel keeps its own layout (here the transpose) and
    a new closure."""

    def create_weights(self, layer, *args, **kwargs):
        raise AssertionError("not used")

    def apply(self, layer, *args, **kwargs):
        raise AssertionError("not used")

    def process_weights_after_loading(self, layer):
        layer.weight = nn.Parameter(layer.weight.t().contiguous(), requires_grad=False)
        packed = layer.weight.detach().clone()
        layer.kernel = lambda x: x @ packed


class Linear(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, k), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # bound to the layer, as vLLM's are
        self.bias = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.bias.weight_loader = self.weight_loader
        self.quant_method = UnquantizedTransposing()
        self.loads = 0

    def weight_loader(self, param, loaded_weight):
        self.loads += 1
        param.data.copy_(loaded_weight)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Linear(4, 3)
        self.b = Linear(3, 2)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(3), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)


def loaded_model() -> Model:
    """As vLLM loads one: the checkpoint form recorded, then loaded and processed."""
    m = Model()
    record_metadata_for_reloading(m)
    with torch.no_grad():
        for i, (name, p) in enumerate(m.named_parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + i)
        for layer in (m.a, m.b):
            layer.quant_method.process_weights_after_loading(layer)
    return m


def snapshot(m: Model) -> dict:
    return {n: t.clone() for n, t in m.state_dict().items()}


def same(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_prepare_reads_the_live_model_and_commit_copies_the_processed_tensors_in():
    m = loaded_model()
    before, kernel_b, weight_a = snapshot(m), m.b.kernel, m.a.weight
    new = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "norm.weight": torch.randn(3)}

    prepared = prepare(m, new)
    assert same(snapshot(m), before) and m.a.loads == 0  # nothing live written, no live loader called
    assert {type(live).__name__ for live, _ in prepared.layers} == {"Linear", "Module"}  # a and norm, not b

    assert prepared.commit() > 0
    assert m.a.weight is weight_a  # copied into the live storage, not replaced
    assert torch.equal(m.a.weight, new["a.weight"].t())  # in the kernel's layout
    assert torch.equal(m.a.bias, new["a.bias"]) and torch.equal(m.norm.weight, new["norm.weight"])
    x = torch.randn(2, 4)
    assert torch.allclose(m.a.kernel(x), x @ new["a.weight"].t())  # the new closure
    assert m.b.kernel is kernel_b and torch.equal(m.b.weight, before["b.weight"])  # untouched layer
    assert set(vars(m.a)) == set(vars(Linear(4, 3))) | {"kernel"}  # no bookkeeping of the shadow's came along


def test_a_processed_tensor_that_does_not_fit_changes_nothing():
    m = loaded_model()
    prepared = prepare(m, {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3), "norm.weight": torch.randn(3)})
    m.norm.weight = nn.Parameter(torch.ones(5), requires_grad=False)  # the live model changed shape since
    before = snapshot(m)
    with pytest.raises(Unsupported, match="does not fit"):
        prepared.commit()
    assert same(snapshot(m), before)  # checked before the first copy: a's tensors did not go in either


def test_a_load_into_a_tensor_vllm_recorded_no_form_of_is_refused_and_the_live_one_kept():
    m = loaded_model()
    m.b.extra = nn.Parameter(torch.zeros(2), requires_grad=False)  # registered after vLLM recorded the layer
    before = snapshot(m)
    with pytest.raises(Unsupported, match="recorded no checkpoint form"):
        prepare(m, {"b.extra": torch.ones(2)})
    assert same(snapshot(m), before)


def test_a_preparation_runs_in_a_thread_and_reports_its_failure():
    m = loaded_model()
    ok = Preparation(m, {"norm.weight": torch.full((3,), 2.0)})
    assert ok.result() is not None and ok.error is None and ok.done
    bad = Preparation(m, {"missing.weight": torch.ones(1)})
    assert bad.result() is None and "KeyError" in bad.error


def test_a_quantized_layer_is_left_to_vllms_reload():
    class Quantizing(UnquantizedTransposing):  # named as vLLM's quantized methods are: not "Unquantized..."
        pass

    m = loaded_model()
    m.a.quant_method = Quantizing()
    with pytest.raises(Unsupported, match="quantized by Quantizing"):
        prepare(m, {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3)})


class UnquantizedHandle(QuantizeMethodBase):
    """Processing as a CPU embedding's or output layer's: the weight stays, a GEMM handle is built from it."""

    def create_weights(self, layer, *args, **kwargs):
        raise AssertionError("not used")

    def apply(self, layer, *args, **kwargs):
        raise AssertionError("not used")

    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone()
        layer.kernel = lambda: packed


class Tied(nn.Module):
    """An output layer that shares the embedding's weight, as vLLM ties them (`lm_head.weight =
    embed_tokens.weight`): the checkpoint has the embedding only."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.zeros(5, 3), requires_grad=False)
        self.model.embed_tokens.quant_method = UnquantizedHandle()
        self.lm_head = nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head.quant_method = UnquantizedHandle()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)


def test_a_tied_output_layer_gets_a_handle_over_the_new_embedding():
    m = Tied()
    record_metadata_for_reloading(m)
    for layer in (m.model.embed_tokens, m.lm_head):
        layer.quant_method.process_weights_after_loading(layer)
    new = torch.randn(5, 3)

    prepare(m, {"model.embed_tokens.weight": new}).commit()
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still one tensor
    assert torch.equal(m.model.embed_tokens.weight, new)
    assert torch.equal(m.model.embed_tokens.kernel(), new) and torch.equal(m.lm_head.kernel(), new)


def test_a_model_that_loads_around_the_weight_loaders_is_left_to_vllms_reload():
    class Direct(Model):
        def load_weights(self, weights):  # copies into the parameter itself: nothing would load
            params = dict(self.named_parameters())
            for name, w in weights:
                params[name].data.copy_(w)

    m = Direct()
    record_metadata_for_reloading(m)
    with pytest.raises(Unsupported, match="sent 6 elements, 0 reached"):
        prepare(m, {"norm.weight": torch.ones(3), "a.bias": torch.ones(3)})


def test_after_a_reload_the_vllm_way_the_prepared_one_still_loads():
    """vLLM's reload leaves its layerwise wrappers on the tensors it recorded (they load nothing once
    its reload is over); the prepared reload calls the tensors' own loaders under them."""
    m = loaded_model()
    first = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3)}
    initialize_layerwise_reload(m)  # vLLM's reload_weights, as its CPU path runs it
    m.load_weights(iter(first.items()))
    finalize_layerwise_reload(m, None)
    assert torch.equal(m.a.weight, first["a.weight"].t())

    second = {"a.weight": torch.randn(3, 4), "a.bias": torch.randn(3)}
    prepare(m, second).commit()
    assert torch.equal(m.a.weight, second["a.weight"].t()) and torch.equal(m.a.bias, second["a.bias"])
