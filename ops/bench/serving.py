"""Serving overhead: bare vLLM AsyncLLM in-process against Flywheel over HTTP via Ray Serve.

Same model, same fill-in-the-middle prompts (token for token), same sampling, same
concurrency, same machine, one run. The
baseline calls the engine directly; Flywheel's path adds HTTP, the FastAPI ingress, a
Ray Serve handle hop to the replica, prompt building, and the completion record to Kafka.
The baseline runs first and its engine is shut down before Flywheel starts, so the two
never share the CPU.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from feedback.core.server_timing import breakdown, parse_header
from feedback.core.stats import percentile
from serving.engine import SamplingSpec

# (prefix, suffix): fill-in-the-middle, what editors send.
PROMPTS = [
    ("import os\nimport sys\n\n\ndef main(argv):\n    ", "\n\n\nif __name__ == '__main__':\n    main(sys.argv)\n"),
    (
        "class Config:\n    def __init__(self, path):\n        self.path = path\n\n    def load(self):\n        ",
        "\n        return data\n",
    ),
    ("def read_lines(path):\n    with open(path) as f:\n        ", "\n    return lines\n"),
    ("for key, value in sorted(items.items()):\n    ", "\nprint(total)\n"),
]


@dataclass
class Side:
    name: str
    requests: int
    seconds: float
    completion_tokens: int
    p50_ms: float
    p99_ms: float
    errors: int
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    """Where a request's time went: {stage: {"mean_ms", "p50_ms"}} (see `breakdown`)."""

    @classmethod
    def measured(
        cls, name: str, n: int, secs: float, tokens: int, lat: list[float], errors: int, timings: list[dict]
    ) -> Side:
        """A side from its run: latencies in ms and, per answered request, its stage times."""
        stages = breakdown(timings, lat) if len(timings) == len(lat) else {}  # not when some failed
        return cls(name, n, secs, tokens, statistics.median(lat), percentile(lat, 0.99), errors, stages)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds


async def _drive(n: int, concurrency: int, one) -> tuple[float, list[float], int, int]:
    sem = asyncio.Semaphore(concurrency)
    lat, tokens, errors = [], 0, 0

    async def task(i: int):
        nonlocal tokens, errors
        async with sem:
            t0 = time.perf_counter()
            try:
                tokens += await one(*PROMPTS[i % len(PROMPTS)])
            except Exception:  # counted, not fatal: the benchmark reports failures
                errors += 1
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(task(i) for i in range(n)))
    return time.perf_counter() - t0, lat, tokens, errors


async def bare_vllm(model_dir: Path, settings, n: int, concurrency: int, max_tokens: int) -> Side:
    from learner.fim import fim_prompt_ids
    from learner.formats import read_format
    from learner.tokenizer import load_tokenizer
    from serving.engine import VLLMEngine

    tok = load_tokenizer(model_dir)
    fmt = read_format(model_dir)
    engine = VLLMEngine(model_dir, settings.serve.fitted_to(fmt.window).engine)
    spec = SamplingSpec(
        max_tokens=max_tokens, temperature=0.0, stream=False
    )  # as the replica asks for non-streaming requests

    timings: list[dict[str, float]] = []

    async def one(prefix: str, suffix: str) -> int:
        t0 = time.perf_counter()
        ids = fim_prompt_ids(fmt, tok, prefix, suffix)
        t1 = time.perf_counter()
        final = []
        async for final in engine.generate(ids, spec, uuid.uuid4().hex):
            pass
        t = {"prompt": (t1 - t0) * 1000, "engine": (time.perf_counter() - t1) * 1000}
        if final and final[0].first_token_s is not None:
            t["ttft"] = final[0].first_token_s * 1000
        timings.append(t)
        return len(final[0].token_ids)

    try:
        await _drive(concurrency, concurrency, one)  # warm-up
        timings.clear()
        secs, lat, tokens, errors = await _drive(n, concurrency, one)
    finally:
        engine.shutdown()
    return Side.measured("bare vLLM AsyncLLM (in-process)", n, secs, tokens, lat, errors, timings)


async def flywheel_http(url: str, token: str, n: int, concurrency: int, max_tokens: int) -> Side:
    # aiohttp, as vLLM's own serving benchmark: the load generator shares the cores with what it
    # measures, so it should be the lighter of the two clients.
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(base_url=url, headers=headers, timeout=timeout) as client:
        timings: list[dict[str, float]] = []

        async def one(prefix: str, suffix: str) -> int:
            body = {"prompt": prefix, "suffix": suffix, "max_tokens": max_tokens, "temperature": 0}
            async with client.post("/v1/completions", json=body) as r:
                r.raise_for_status()
                timings.append(parse_header(r.headers.get("server-timing", "")))
                return (await r.json())["usage"]["completion_tokens"]

        await _drive(concurrency, concurrency, one)
        timings.clear()
        secs, lat, tokens, errors = await _drive(n, concurrency, one)
    return Side.measured("Flywheel: HTTP -> Ray Serve -> vLLM (+ Kafka record)", n, secs, tokens, lat, errors, timings)


def run(settings, model_dir: Path, *, n: int, concurrency: int, max_tokens: int, progress) -> dict:
    import secrets

    from ops.routes import ops_routers
    from serving import app

    # One dtype for both sides, decided once (app.start would decide it again for Flywheel).
    settings = app.with_local_precision(settings, progress)
    progress(f"baseline: bare AsyncLLM, {n} requests x {max_tokens} tokens, concurrency {concurrency}")
    bare = asyncio.run(bare_vllm(model_dir, settings, n, concurrency, max_tokens))
    progress(f"baseline: {bare.rps:.1f} req/s, p50 {bare.p50_ms:.0f} ms, p99 {bare.p99_ms:.0f} ms")
    token = secrets.token_urlsafe(16)
    from pydantic import SecretStr

    # One client measures throughput flat out: no per-token rate limit.
    limits = settings.serve.limits.model_copy(update={"completions": ""})
    s = settings.model_copy(
        update={
            "serve": settings.serve.model_copy(
                update={
                    "auth_tokens": [SecretStr(token)],
                    "model_dir": model_dir,
                    "canary_replicas": 0,
                    "limits": limits,
                }
            )
        }
    )
    progress("Flywheel: starting Ray Serve with one vLLM replica")
    url = app.start(s, model_dir, s.serve.model_version, progress, routers=ops_routers())
    try:
        progress(f"Flywheel: {n} requests over HTTP")
        fly = asyncio.run(flywheel_http(url, token, n, concurrency, max_tokens))
    finally:
        app.stop()
    return {
        "model_dir": str(model_dir),
        "requests": n,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "bare": asdict(bare) | {"rps": bare.rps, "tokens_per_s": bare.tokens_per_s},
        "flywheel": asdict(fly) | {"rps": fly.rps, "tokens_per_s": fly.tokens_per_s},
        "throughput_ratio": fly.rps / bare.rps,
    }
