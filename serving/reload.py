"""A prepared in-place reload: the new weights are built in the layout the kernels hold beside the
live model while it serves, and the swap's pause only copies them in. Runs in the vLLM worker.

vLLM's own in-place reload (`reload_weights`) does all of its work on the live model, so all of it
falls inside a swap's pause: it puts every touched layer back into checkpoint form, loads each
tensor twice (once under a copy-counting dispatch mode to learn when a layer is complete, once
for real), runs each layer's `process_weights_after_loading` (a CPU linear layer builds a new
oneDNN handle, the experts are repacked) and copies the result into the kernel tensors. Measured
with py-spy on the demo model's worker over 30 idle reloads of all 135 tensors: 45 ms median, 83%
of it in that path.

Here the same steps run on a shadow of the model:

  prepare(model, tensors)         (a thread in the worker, while the engine keeps stepping)
    a shallow copy of the module tree: every module a new object whose parameter, buffer and
    child dicts are its own, sharing everything else (configs, quant methods, kernels) with the
    live module; the loadable tensors are placeholders on the meta device, built from the
    checkpoint-format metadata vLLM recorded when it loaded the model
    the model's own `load_weights` on the shadow (vLLM's name mapping, fusing q/k/v, gate/up
    and the experts): a layer's placeholders become real tensors at its first load
    each loaded layer's `process_weights_after_loading` on the shadow layer, then what
    Flywheel's reload redoes on the CPU (the experts' prepack, a tied output layer's GEMM handle)
  commit()                        (inside the pause)
    checks that every processed tensor has the shape and dtype of the live tensor it replaces,
    before touching any; copies them into the live storage; sets the attributes processing
    replaced (a CPU linear layer's `cpu_linear` closure around its new oneDNN handle)

A layer kind this does not handle (a quantized layer, whose processing has steps of its own; an
attention layer with loadable scales, which vLLM processes last) raises `Unsupported` in
`prepare`, as does a model whose `load_weights` writes around the tensors' loaders (fewer elements
reach them than were sent); the caller then reloads the vLLM way inside the pause. Nothing here
writes to the live model before `commit`. An earlier reload the vLLM way leaves its layerwise
wrappers on the recorded tensors; the tensors' own loaders under them are the ones called.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from dataclasses import dataclass, field
from types import MethodType

_TREE_DICTS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_LOADED_AS_IS = ("bias",)  # vLLM's SKIP_TENSORS less SKIP_LOAD_TENSORS: loaded, not recorded


class Unsupported(RuntimeError):
    """The model holds a layer this reload does not prepare: reload it the vLLM way."""


def cpu_experts(layer):
    """The CPU grouped-GEMM experts kernel of an MoE layer (vLLM's `CPUUnquantizedExperts`), or None."""
    experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if experts is not None and any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
        return experts
    return None


def tied_output_layer(model):
    """(output layer, embedding) where the output layer shares the embedding's weight, else None."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    if weight is None or embed is None or weight.data_ptr() != embed.weight.data_ptr():
        return None
    return head, embed


@dataclass
class Prepared:
    """Processed tensors and attributes for the live layers they replace."""

    layers: list[tuple[object, object]] = field(default_factory=list)  # (live layer, processed shadow)
    seconds: dict[str, float] = field(default_factory=dict)

    def commit(self) -> int:
        """Copy the processed tensors into the live model; returns the bytes copied. All shapes and
        dtypes are checked before the first copy, so a mismatch changes nothing."""
        copies, attrs = [], []
        for live, shadow in self.layers:
            current = _tensors(live)
            for name, new in _tensors(shadow).items():
                old = current.get(name)
                if old is new:
                    continue
                if old is None or old.is_meta or old.shape != new.shape or old.dtype != new.dtype:
                    raise Unsupported(
                        f"{type(live).__name__}.{name}: processed {tuple(new.shape)} {new.dtype} does not fit the "
                        f"live {None if old is None else (tuple(old.shape), old.dtype)}"
                    )
                copies.append((old, new))
            for key, value in shadow.__dict__.items():
                if key not in _TREE_DICTS and live.__dict__.get(key, _MISSING) is not value and not _is_tensor(value):
                    attrs.append((live, key, value))
        seen, nbytes = set(), 0
        for old, new in copies:
            if old.data_ptr() in seen:  # a tied output layer shares the embedding's storage
                continue
            seen.add(old.data_ptr())
            old.data.copy_(new)
            nbytes += new.nbytes
        for live, key, value in attrs:
            object.__setattr__(live, key, value)
        return nbytes


_MISSING = object()


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _tensors(module) -> dict:
    return {n: t for d in (module._parameters, module._buffers) for n, t in d.items() if t is not None}


def prepare(model, tensors: dict) -> Prepared:
    """Load `tensors` (checkpoint names and format) into a shadow of `model` and process them into
    kernel layout; the live model is only read."""
    import torch
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_MODULES

    t0 = time.perf_counter()
    shadow_of: dict[int, object] = {}
    live_of: dict[int, object] = {}
    loaded = _Loaded()

    def clone(module):
        if id(module) in shadow_of:  # a module held in two places (a tied head) stays one
            return shadow_of[id(module)]
        s = module.__class__.__new__(module.__class__)
        s.__dict__.update(module.__dict__)
        s._parameters, s._buffers = dict(module._parameters), dict(module._buffers)
        s._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        shadow_of[id(module)], live_of[id(s)] = s, module
        s._modules = {k: (None if m is None else clone(m)) for k, m in module._modules.items()}
        if type(module).__name__ in SKIP_MODULES:
            return s
        info = LAYERWISE_INFO.get(module)
        meta_params, meta_buffers = info.restore_metadata if info is not None else ({}, {})
        for meta, target in ((meta_params, s._parameters), (meta_buffers, s._buffers)):
            # vLLM records the checkpoint form of every loadable tensor but the biases, which it
            # loads into the live tensor (their form does not change). Any other tensor stays the
            # live one, behind a placeholder that refuses a load: nothing may write to it here.
            for name in meta.keys() | {n for n, t in target.items() if t is not None}:
                if name in SKIP_LOAD_TENSORS:
                    continue
                live = target.get(name)
                if name in meta:
                    target[name] = _placeholder(meta[name], module, s, name, loaded)
                elif name in _LOADED_AS_IS:
                    target[name] = _placeholder(live, module, s, name, loaded)
                else:
                    target[name] = _placeholder(live, module, s, name, loaded, keep=live)
        return s

    root = clone(model)
    t1 = time.perf_counter()
    with torch.no_grad():
        root.load_weights(iter(tensors.items()))
    t2 = time.perf_counter()
    sent = sum(t.numel() for t in tensors.values())
    if loaded.numel < sent:  # a tensor loaded around its loader went into a placeholder: lost
        raise Unsupported(
            f"the model's load_weights was sent {sent} elements, {loaded.numel} reached the tensors' loaders"
        )
    prepared = Prepared()
    with torch.no_grad():
        for s in loaded.layers.values():
            live = live_of[id(s)]
            if _is_deferred_attention(live):
                raise Unsupported(f"{type(live).__name__}: vLLM processes attention layers last")
            s.__dict__.pop("_already_called_process_weights_after_loading", None)
            quant = getattr(s, "quant_method", None)
            if isinstance(quant, QuantizeMethodBase) and not type(quant).__name__.startswith("Unquantized"):
                # a quantized layer's processing (online fp8, ...) has steps of its own: vLLM's reload
                raise Unsupported(f"{type(live).__name__}: quantized by {type(quant).__name__}")
            if isinstance(quant, QuantizeMethodBase):
                quant.process_weights_after_loading(s)
                if hasattr(s, "update_param_tp_status"):
                    s.update_param_tp_status()
            if (experts := cpu_experts(s)) is not None:
                experts.process_weights_after_loading(s)  # vLLM's reload skips this prepack (hotswap.py)
            prepared.layers.append((live, s))
        prepared.layers += _tied_output_layer(model, shadow_of, loaded)
    prepared.seconds = {"shadow": t1 - t0, "load": t2 - t1, "process": time.perf_counter() - t2}
    return prepared


@dataclass
class _Loaded:
    layers: dict[int, object] = field(default_factory=dict)  # shadow layers that received a tensor, by id
    numel: int = (
        0  # elements of the checkpoint tensors handed to the tensors' loaders (vLLM may group several per call)
    )


def _placeholder(source, live, shadow, name: str, loaded: _Loaded, keep=None):
    """A meta tensor standing for `name` of `shadow` in `load_weights`: the first load into the
    layer materializes all of its placeholders (empty, in the recorded shape), then loads into the
    real tensor with the tensor's own loader, bound to the shadow layer. With `keep` (a live tensor
    vLLM recorded no checkpoint form of), the layer keeps that tensor and a load into it raises
    `Unsupported`."""
    import torch
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    def own(value):  # methods bound to the live layer (or vLLM's sentinel for it) bind to the shadow
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            return value.__func__.__get__(shadow)
        return value

    attrs = {k: own(v) for k, v in source.__dict__.items()}
    meta = torch.empty_strided(tuple(source.size()), tuple(source.stride()), dtype=source.dtype, device="meta")
    meta.__class__ = source.__class__
    meta.__dict__ = dict(attrs)
    # The tensor's own loader (vLLM's parameters keep it in `_weight_loader`). An earlier reload the
    # vLLM way leaves its layerwise wrappers on the recorded tensors; they would load nothing now.
    loader = getattr(source, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    loader = own(loader)
    signature = inspect.signature(loader)

    def materialize() -> None:
        for d in (shadow._parameters, shadow._buffers):
            for n, t in d.items():
                if t is not None and t.is_meta and hasattr(t, "_flywheel_real"):
                    d[n] = t._flywheel_real()
        loaded.layers[id(shadow)] = shadow

    def real():
        if keep is not None:
            return keep
        t = torch.empty_strided(tuple(source.size()), tuple(source.stride()), dtype=source.dtype, device="cpu")
        t.__class__ = source.__class__
        t.__dict__ = dict(attrs)
        t.weight_loader = load  # a model may look its tensors up again after the first load
        return t

    def load(*args, **kwargs):
        if keep is not None:
            raise Unsupported(f"{type(live).__name__}.{name}: a load into a tensor vLLM recorded no checkpoint form of")
        if id(shadow) not in loaded.layers:
            materialize()
        bound = signature.bind(*args, **kwargs)
        bound.arguments["param"] = _tensors(shadow)[name]
        loaded.numel += sum(
            v.numel() for k, v in bound.arguments.items() if k != "param" and isinstance(v, torch.Tensor)
        )
        return loader(*bound.args, **bound.kwargs)

    meta._flywheel_real = real
    meta.weight_loader = load
    return meta


def _is_deferred_attention(layer) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return is_deferred_attention_layer(layer)


def _tied_output_layer(model, shadow_of: dict, loaded: _Loaded) -> list[tuple[object, object]]:
    """A tied output layer computes through a GEMM handle prepacked from the embedding's weight
    (hotswap._refresh_tied_output_layer): a shadow of it over the new embedding, processed."""
    tied = tied_output_layer(model)
    if tied is None or tied[0] is tied[1] or id(shadow_of.get(id(tied[1]))) not in loaded.layers:
        return []
    head, embed = tied
    s_head = shadow_of[id(head)]
    s_head._parameters["weight"] = shadow_of[id(embed)].weight
    head.quant_method.process_weights_after_loading(s_head)
    return [(head, s_head)]


class Preparation:
    """`prepare` in a thread of the worker: started when a swap's file is staged, committed in the
    pause. `result()` is the Prepared, or None when it failed (the reason in `error`)."""

    def __init__(self, model, tensors: dict, context=contextlib.nullcontext):
        self.error: str | None = None
        self._prepared: Prepared | None = None
        self._thread = threading.Thread(
            target=self._run, args=(model, tensors, context), name="flywheel-prepare", daemon=True
        )
        self._thread.start()

    def _run(self, model, tensors, context) -> None:
        try:
            with context():
                self._prepared = prepare(model, tensors)
        except Exception as e:  # reported through `error`; the swap reloads the vLLM way
            self.error = f"{type(e).__name__}: {e}"

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Prepared | None:
        self._thread.join()
        return self._prepared
