"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from feedback.core.config import StackSettings

REPO = Path(__file__).resolve().parents[1]
"""The repository root (where pyproject.toml and flywheel.example.toml live)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_server(app, *, log_level: str = "warning", start_s: float = 30) -> Iterator[int]:
    """`app` on a real uvicorn server in a thread, on 127.0.0.1; yields its port.

    The socket is bound here, to a port the system picks, and handed to uvicorn: the port is
    held from the moment it is chosen. (With `free_port()`, another process could take it before
    uvicorn bound it; uvicorn's thread then ended unstarted and the test waited out its deadline.)
    A server whose thread ends before it started (its app's startup failed) is reported at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # uvicorn exits (SystemExit) on a failed startup; keep the cause
            failed.append(e.__context__ or e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + scaled(start_s)
        while not server.started:
            assert thread.is_alive(), f"uvicorn's thread ended before the server started: {failed or 'see its log'}"
            assert time.monotonic() < deadline, f"uvicorn did not start within {scaled(start_s):g} s"
            time.sleep(0.05)
        yield port
    finally:
        server.should_exit = True
        thread.join(scaled(10))
        sock.close()


def make_settings(tmp: Path, **overrides) -> StackSettings:
    """Settings isolated in `tmp`, sharing the user's download cache (Kafka jars)."""
    base = {"data_dir": str(tmp / "data")}
    if cache := os.environ.get("FLYWHEEL_CACHE_DIR"):
        base["cache_dir"] = cache
    return StackSettings(**(base | overrides))


def flywheel(
    *args: str, env: dict | None = None, tmp_path: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """Run the `flywheel` CLI as a user would, isolated in `tmp_path`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    if tmp_path is not None:
        full_env["FLYWHEEL_DATA_DIR"] = str(tmp_path / "data")
    if "FLYWHEEL_CACHE_DIR" in os.environ:
        full_env["FLYWHEEL_CACHE_DIR"] = os.environ["FLYWHEEL_CACHE_DIR"]
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=scaled(timeout),
        cwd=tmp_path,
    )


# --- waits that scale with the machine ------------------------------------------------------------

TIMEOUT_FACTOR_ENV = "FLYWHEEL_TEST_TIMEOUT_FACTOR"


def timeout_factor() -> float:
    """One factor for every wait in the suite (`FLYWHEEL_TEST_TIMEOUT_FACTOR`, default 1): on a
    slower or loaded machine, raise it instead of editing seconds. Waits are upper bounds: a
    test goes on as soon as its condition holds, so a large factor costs nothing when it passes."""
    raw = os.environ.get(TIMEOUT_FACTOR_ENV, "1")
    try:
        factor = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_FACTOR_ENV}={raw!r} is not a number") from None
    if not factor > 0:
        raise ValueError(f"{TIMEOUT_FACTOR_ENV} must be positive, got {raw}")
    return factor


def scaled(seconds: float) -> float:
    """`seconds` times the suite's timeout factor."""
    return seconds * timeout_factor()


# --- how far served logprobs may be from the learner's ---------------------------------------------


def served_logprob_tolerance(model, sequences, served_dtype: str) -> float:
    """The largest |served logprob - learner logprob| to accept on these tokens, derived from a bound.

    The learner computes in fp32; the engine computes in `served_dtype` on the same (bf16-stored)
    weights. Rounding to a dtype with unit roundoff u perturbs every activation by at most u
    relative, and how much that moves a logprob depends on the model and the tokens. We measure
    exactly that on this machine: δ = max |logprob computed in `served_dtype` - logprob computed
    in float64| over the same tokens, with our own forward. vLLM rounds in the same dtype, but more
    often than our forward (it also rounds the residual stream, the norms' outputs and the fused
    MoE in that dtype) and in its own order: its deviation from exact is a small multiple of δ
    (measured up to 3.4δ in bf16 on an AVX2 CPU). We allow 8δ. On top, 2e-3 for what every dtype
    shares: fp32 reduction order and the sampler's logsumexp (measured below 1e-4 in fp32). A
    real mismatch (RoPE, norms, routing, the wrong weights) moves logprobs by whole units, far
    above this. `sequences`: (prompt_ids, generated_ids) pairs."""
    import torch

    dtype = getattr(torch, served_dtype)

    def logprobs(m):
        out = []
        for prompt, gen in sequences:
            with torch.no_grad():
                logits = m(torch.tensor([list(prompt) + list(gen)]))[0, len(prompt) - 1 : -1]
            lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(gen)), list(gen)]
            out.append(lp)
        return torch.cat(out)

    import copy

    exact = logprobs(copy.deepcopy(model).double())
    rounded = logprobs(copy.deepcopy(model).to(dtype))
    delta = float((rounded - exact).abs().max())
    return 8 * delta + 2e-3


def cpu_report() -> str:
    """One line on this machine's CPU and the dtype Flywheel computes in here (the session header)."""
    import torch

    from feedback.core.precision import cpu_bf16_flags, resolve

    flags = ", ".join(cpu_bf16_flags()) or "no native bf16"
    return (
        f"cpu: torch capability {torch.backends.cpu.get_cpu_capability()} ({flags}); compute dtype {resolve('auto')}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )


# --- tokenizers in other families' image ----------------------------------------------------------


def family_tokenizer(texts, vocab_size: int, specials: list[str]):
    """A byte-level BPE trained on `texts` with no special tokens of its own, then `specials`
    added after the learned vocabulary: as in Qwen's tokenizer, the special tokens (EOS among
    them) sit at the end, far from id 0 (a byte-level vocabulary's id 0 is "!")."""
    from tokenizers import pre_tokenizers, trainers

    from learner.tokenizer import build_untrained_tokenizer

    tok = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(specials)
    return tok


def logprob_policy(**over):
    """A show policy (learner/show.py) on the five logprob features, standardized as they are:
    p = sigmoid(bias + sum(weights * features)). By default it reads the first logprob alone,
    p = sigmoid(2 * (first_logprob + 1)), and shows from 0.25."""
    from learner.show import LOGPROB_FEATURES, ShowPolicy

    fields = dict(
        mean=(0.0,) * 5,
        scale=(1.0,) * 5,
        weights=(2.0, 0.0, 0.0, 0.0, 0.0),
        bias=2.0,
        threshold=0.25,
        samples=100,
        accepts=30,
        features=LOGPROB_FEATURES,
    )
    return ShowPolicy(**(fields | over))
