"""Serving fixtures: a fake engine behind the `Engine` interface, a real one, local pools, the app."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from fastapi.testclient import TestClient

from feedback.pools import STABLE
from learner.export import export_hf
from learner.formats import own_format
from learner.model import ModelArgs, Transformer
from serving.engine import Sample, SamplingSpec, VLLMEngine
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.http.routing import RoutingState
from serving.replica import CompletionService
from serving.settings import ServeSettings

TOKEN = "editor-test-token"


@dataclass
class FakeEngine:
    """Deterministic stand-in for vLLM: answers with fixed text, tokenized for real."""

    tok: object
    text: str = "return x"
    calls: list = field(default_factory=list)
    fail: bool = False
    first_token_s: float | None = None  # what the engine reports as its time to first token
    routing: str | None = None  # the routing trace it reports with a finished request's first sample
    first_logprob: float = -0.5  # the logprob it gives the first token (the others get -0.5)

    async def generate(self, prompt_ids, spec: SamplingSpec, request_id):
        self.calls.append((prompt_ids, spec, request_id))
        if self.fail:
            raise RuntimeError("engine down")
        ids = self.tok.encode(self.text, add_special_tokens=False).ids[: spec.max_tokens]
        for k in range(1, len(ids) + 1):
            done = k == len(ids)
            yield [
                Sample(
                    index=i,
                    token_ids=ids[:k],
                    logprobs=[self.first_logprob] + [-0.5] * (k - 1),
                    top_logprobs=[{t: -0.5} for t in ids[:k]] if spec.top_logprobs else [],
                    text=self.tok.decode(ids[:k]),
                    finish_reason=("length" if k == spec.max_tokens else "stop") if done else None,
                    first_token_s=self.first_token_s,
                    routing=self.routing if done and i == 0 else None,
                )
                for i in range(spec.n)
            ]

    async def abort(self, request_id):
        pass


class LocalPool:
    """A replica pool of one in-process CompletionService (the ingress gets Ray handles instead).
    `reports` overrides the version it claims to serve, as a pool mid-swap may."""

    def __init__(self, service: CompletionService, reports: int | None = None):
        self.service, self.reports = service, reports

    async def complete(self, req):
        return await self.service.complete(req)

    def stream(self, req):
        return self.service.stream(req)

    async def served_version(self) -> int:
        return self.service.version if self.reports is None else self.reports


class ListSink:
    def __init__(self):
        self.sent = []

    def send(self, topic, msg):
        self.sent.append((topic, msg))
        return True


def make_client(tok, engine=None, routers=(), *, min_confidence: float = 0.0, **cfg_overrides):
    """A client of an app of serving's routes and `routers` over a FakeEngine pool on v3, its sink, its engine."""
    cfg = ServeSettings(**({"auth_tokens": [TOKEN]} | cfg_overrides))
    engine = engine or FakeEngine(tok)
    service = CompletionService(engine, tok, own_format(tok, 2048), cfg, version=3, min_confidence=min_confidence)
    sink = ListSink()
    app = build_app(routers=routers)
    app.state.api = ApiState(
        cfg=cfg,
        replicas={STABLE: LocalPool(service)},
        routing=RoutingState(serving={STABLE: 3}),
        producer=sink,
        editor_tokens=cfg.editor_tokens(),
        decode=tok.decode,
        token_users=cfg.editor_token_users(),
    )
    client = TestClient(app, raise_server_exceptions=False)
    client.headers["Authorization"] = f"Bearer {TOKEN}"
    return client, sink, engine


@pytest.fixture(scope="module")
def vllm_engine(tok, tmp_path_factory):
    """The real engine (vLLM's AsyncLLM, as a replica owns it) with the settings `make_client`
    serves with, on a tiny random model with the session's tokenizer; shared by a module's tests.
    Its output handler lives on the event loop of its first request: use it from one loop (one
    `with TestClient(...)` block)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = ModelArgs.from_name("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=2048)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(0.1)
    folder = export_hf(model, args, tok, tmp_path_factory.mktemp("vllm_model"))
    engine = VLLMEngine(folder, ServeSettings().engine)
    yield engine
    engine.shutdown()
