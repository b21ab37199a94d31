"""The compute dtype, chosen by the hardware: bfloat16 only where it runs fast, float32 elsewhere.

Why: CPUs of the same kind differ. One with AVX-512 BF16 or AMX multiplies bf16 matrices
about as fast as fp32 or faster; an AVX2-only one (no native bf16) runs torch's bf16 matmul
about 75x slower than fp32 (measured on an AMD EPYC with torch 2.13+cpu: 1.2 vs 89 GFLOP/s
on 512x512). Pretraining under a time budget then makes a model worse than its bigram
baseline, and vLLM serves at less than half the speed.

`resolve("auto")` decides once per process:
  - CUDA: bfloat16 where the GPU supports it (compute capability 8.0+), else float32;
  - CPU: a short measured probe (a 256x256 matmul in each dtype, single thread, about 0.1 s)
    picks bfloat16 when it is at most `_SLOWER_OK` times slower than float32; the CPU's
    bf16-related flags (/proc/cpuinfo) are reported beside it. Training asks for bf16 only
    where it is not slower at all (`TRAINING_SLOWER_OK`): a training step is compute-bound, and
    on an AVX-512 BF16 CPU without AMX, whose probe measures bf16 1.9-2.0x slower, pretraining in
    fp32 ran 1.48x the tokens/s of bf16 at the same loss per step (80 steps of `small` each:
    2,778 against 1,873 tokens/s, held-out loss 4.87 against 4.90). Serving keeps the looser
    bound: there bf16 answered as fast as fp32 (`flywheel bench serve`: 34-38 against 33 req/s).
The probe compares the two dtypes in the same process at the same moment, so a loaded
machine slows both alike: the ~75x gap and the ~1x ratio stay far apart.

Anything but "auto" is an explicit override and is used as given (`pretrain.precision`,
`serve.engine.dtype`, or `FLYWHEEL_PRECISION` for every component at once).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

ENV_OVERRIDE = "FLYWHEEL_PRECISION"
_SLOWER_OK = 2.0  # bf16 is "fast" when it is at most this many times slower than fp32
TRAINING_SLOWER_OK = 1.0  # for training: only when it is not slower (see above; `training`)
_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


@dataclass(frozen=True)
class Precision:
    dtype: str  # "bfloat16" | "float32" | "float16": torch / vLLM spelling
    reason: str

    @property
    def short(self) -> str:
        return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[self.dtype]

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype} ({self.reason})"


def normalize(name: str) -> str:
    """ "bf16" -> "bfloat16", "fp32" -> "float32", "auto" stays; ValueError otherwise."""
    key = name.strip().lower()
    if key == "auto":
        return key
    if key not in _ALIASES:
        raise ValueError(f"unknown precision {name!r}: use auto, bfloat16 (bf16), float32 (fp32) or float16 (fp16)")
    return _ALIASES[key]


def resolve(
    requested: str = "auto", *, device: str = "cpu", setting: str = "precision", slower_ok: float = _SLOWER_OK
) -> Precision:
    """The dtype to compute in. `requested` is "auto" or a dtype (an override, used as given);
    `FLYWHEEL_PRECISION`, when set, overrides an "auto" for every component. On a CPU, "auto" is
    bf16 where its matmul is at most `slower_ok` times slower than fp32's."""
    want = normalize(requested)
    if want != "auto":
        return Precision(want, f"set by {setting}")
    env = os.environ.get(ENV_OVERRIDE, "").strip()
    if env and normalize(env) != "auto":
        return Precision(normalize(env), f"set by {ENV_OVERRIDE}")
    if device.startswith("cuda"):
        return _cuda_choice()
    return _cpu_choice(slower_ok)


def training(requested: str = "auto", *, device: str = "cpu", setting: str = "pretrain.precision") -> Precision:
    """`resolve` for a training step: on a CPU, bf16 only where it is not slower than fp32."""
    return resolve(requested, device=device, setting=setting, slower_ok=TRAINING_SLOWER_OK)


@functools.cache
def _cuda_choice() -> Precision:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return Precision("bfloat16", f"{torch.cuda.get_device_name()} supports bf16")
    return Precision("float32", "this GPU has no native bf16")


@functools.cache
def _cpu_probe() -> tuple[dict, list[str]]:
    """The matmul probe and the CPU's bf16 flags, measured once per process: serving's and
    training's choices read the same measurement."""
    return measure_matmul(), cpu_bf16_flags()


@functools.cache
def _cpu_choice(slower_ok: float = _SLOWER_OK) -> Precision:
    probe, flags = _cpu_probe()
    isa = f"{probe['capability']}" + (
        f" with {', '.join(flags)}" if flags else ", no native bf16 (avx512_bf16 / amx_bf16)"
    )
    speeds = (
        f"bf16 matmul {probe['bfloat16']:.1f} GFLOP/s vs fp32 {probe['float32']:.1f} on this CPU ({isa}); "
        f"bf16 where at most {slower_ok:g}x slower"
    )
    if probe["bfloat16"] * slower_ok >= probe["float32"]:
        return Precision("bfloat16", speeds)
    return Precision("float32", speeds)


def measure_matmul(n: int = 256, seconds: float = 0.04) -> dict:
    """GFLOP/s of an n x n matmul in float32 and bfloat16 on one thread, and torch's CPU capability."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"capability": torch.backends.cpu.get_cpu_capability()}
        for name in ("float32", "bfloat16"):
            dt = getattr(torch, name)
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            a @ b  # warm-up: first call picks the kernel
            reps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds or reps < 2:
                a @ b
                reps += 1
            out[name] = 2 * n**3 * reps / elapsed / 1e9
        return out
    finally:
        torch.set_num_threads(threads)


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The bf16-related instruction-set flags this CPU reports (empty where none, or not Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _BF16_FLAGS if f in have]
    except OSError:
        pass
    return []
