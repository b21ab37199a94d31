"""FP4 codecs: NVFP4 and MXFP4 quantization, nibble packing, fake quantization for QAT.

Flywheel trains the MoE expert weights with FP4 quantization-aware training and ships them
as packed FP4. Everything here is a pure function on torch tensors; files live elsewhere.

Element format, E2M1 (both formats): values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. A 4-bit code is
sign (bit 3) | magnitude index (bits 0-2), the OCP / NVIDIA encoding, so 0b0111 = 6.0 and
0b1000 = -0.0. Rounding is to nearest, ties to the even magnitude index (the E2M1 encoding
whose mantissa bit is 0), and magnitudes above 6 saturate to 6.

NVFP4: blocks of 16 along the last dim, one FP8 E4M3 scale per block, one FP32 global scale
per matrix (the last two dims; a stack of expert matrices [E, N, K] gets one per expert).
    x ~ e2m1(code) * e4m3(block_scale) * global_scale

MXFP4 (OCP MX v1.0): blocks of 32, one E8M0 scale per block, stored as its biased exponent
(uint8, bias 127): shared_exp = floor(log2(block_amax)) - 2, where 2 is E2M1's largest
exponent; elements that land above 6 after scaling saturate to 6.

Deliberate deviation from NVIDIA's NVFP4 recipe: the global scale is a POWER OF TWO.
NVIDIA uses global_scale = amax / (6 * 448), an arbitrary FP32 number. We pick
global_scale = 2**k with k = floor(log2(amax / 1296)), which places the largest block's
ideal E4M3 scale, amax / (6 * global_scale), in [216, 432). Why:
  * bf16 exactness. A dequantized value is e2m1 (at most 2 significant bits) times e4m3
    (at most 4) times 2**k: at most 6 significant bits, which fits bf16's 8. So the
    bf16 weights the trainer sees (fake quantization), the bf16 weights serving holds and
    the packed checkpoint all describe the same numbers. An arbitrary FP32 global scale
    would make the dequantized values round when they are stored in bf16.
    Where the compute dtype is float32 (a CPU without fast bf16: feedback/core/precision.py) all of
    this still holds: the stored weights stay bf16, every bf16 number is exact in float32 (8 of
    its 24 significand bits), and the fake-quantized fp32 values are the same numbers, so serving
    and training in fp32 compute on exactly the weights the packed checkpoint describes.
  * Lossless round trips. quantize(dequantize(q)) returns q bit for bit: the same codes,
    block scales and global scale. Packed -> bf16 -> packed is therefore lossless, which
    the XOR delta codec and the in-place hot swap rely on. The window [216, 432) makes
    this hold: it is closed under rounding to E4M3 (216 and 432 are E4M3 midpoints whose
    ties round inwards, to 224 and 416), so the re-quantized tensor's amax lands in the
    same binade and picks the same k.
  * Cost: the top block scale reaches at most 416 instead of 448, under 0.1 bit of the
    E4M3 range (about 17.8 binades). Accuracy on Gaussian data is unchanged in practice.
Block scales round to nearest E4M3 from min(ideal, 448), and elements always clamp to +-6,
so a block scale that rounded down can never overflow its block. In E4M3's subnormal
range a scale can round UP by more than 20%; then the block's largest element would encode
as 4, not 6, and a re-quantization would choose a different scale. Such scales step one
E4M3 code down instead (the block's largest element saturates to 6), which keeps round
trips exact. This only touches blocks more than about 2**15 times smaller than the
matrix amax.

Range: inputs must be finite. k is clamped to [-116, 116] so that every dequantized value
is a normal bf16 number and finite; matrices with amax below about 1.6e-32 lose precision
(below about 7e-38 they quantize to zero), and amax above about 2.2e38 saturates slightly.
A matrix whose block scales are all zero gets global scale 1.0.

Storage follows compressed-tensors' "nvfp4-pack-quantized" / "mxfp4-pack-quantized" layout
(see `to_safetensors_dict`), which vLLM loads. Note its convention: `weight_global_scale`
is the DIVISOR, 1 / global_scale (exact here, since global_scale is a power of two).

Shapes: [..., K] is the quantized tensor (K = last dim), B the block size, NB = K // B.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

# code -> value; index bits 0-2 are the magnitude, bit 3 the sign
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Midpoints between consecutive magnitudes. Crossing midpoint i (from index i to i+1) needs
# |x| > m when i is even (a tie stays on even i) and |x| >= m when i is odd (a tie moves to i+1).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# NVFP4 global scale: the largest block's ideal E4M3 scale lands in [216, 432); see docstring.
_NV_TOP_SCALE_LOW = 216.0
_NV_K_MIN, _NV_K_MAX = -116, 116
_MX_BIAS = 127


@dataclass(frozen=True)
class FP4Format:
    """An FP4 block format: E2M1 elements sharing one scale per `block_size` elements."""

    name: str
    block_size: int
    scale_dtype: torch.dtype  # how block scales are stored


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn)
MXFP4 = FP4Format("mxfp4", 32, torch.uint8)  # E8M0 as its biased exponent
FORMATS = {f.name: f for f in (NVFP4, MXFP4)}


def get_format(fmt: FP4Format | str) -> FP4Format:
    """Resolves a format or its name ("nvfp4", "mxfp4"), so configs can name formats."""
    found = FORMATS.get(fmt.name if isinstance(fmt, FP4Format) else fmt)
    if found is None or (isinstance(fmt, FP4Format) and fmt != found):
        raise ValueError(f"unknown FP4 format {fmt!r}; use one of {sorted(FORMATS)}")
    return found


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """The working form: one code per byte, easy to inspect and compare.

    Decodes as E2M1_VALUES[codes] * block scale * global_scale.
    """

    codes: torch.Tensor  # [..., K] uint8, values 0..15
    scales: torch.Tensor  # [..., NB] float8_e4m3fn (nvfp4) or uint8 biased exponent (mxfp4)
    global_scale: torch.Tensor  # [..., 1, 1] float32 power of two, one per matrix; 1.0 for mxfp4
    fmt: FP4Format
    shape: tuple[int, ...]
    dtype: torch.dtype  # dtype of the original tensor


@dataclass(frozen=True, eq=False)
class PackedTensor:
    """The storage and transport form, named as compressed-tensors names NVFP4 / MXFP4 weights.

    `weight_global_scale` follows compressed-tensors: it is the divisor, 1 / global_scale.
    """

    weight_packed: torch.Tensor  # [..., K/2] uint8, two codes a byte, low nibble = even element
    weight_scale: torch.Tensor  # [..., NB] float8_e4m3fn (nvfp4) or uint8 E8M0 (mxfp4)
    weight_global_scale: torch.Tensor | None  # [..., 1] float32 (nvfp4); None for mxfp4
    fmt: FP4Format
    shape: tuple[int, ...]
    dtype: torch.dtype


def _matrix_dims(ndim: int) -> tuple[int, ...]:
    """Dims of a block-scale tensor that one global scale covers: the last two (one matrix)."""
    return (-2, -1) if ndim >= 2 else (-1,)


def _global_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the global scale for a tensor of `shape`: [..., 1, 1], or [1] for a vector."""
    return (*shape[:-2], *(1,) * len(_matrix_dims(len(shape))))


def _check_shape(shape: Sequence[int], fmt: FP4Format) -> None:
    if len(shape) == 0 or math.prod(shape) == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(shape)}: it must be non-empty with at least 1 dim")
    if shape[-1] % fmt.block_size:
        raise ValueError(
            f"{fmt.name} needs the last dim divisible by {fmt.block_size}, got shape {tuple(shape)}; "
            f"pad the last dim or keep this tensor in high precision"
        )


# --- encoding ------------------------------------------------------------------------------------------
#
# The thresholds a value must pass depend only on its block's scale byte and global scale, so they
# come from a table per global scale (7 x 256), gathered per block; the codes are then counted in
# 7 comparisons over the tensor. Ties are decided exactly (see `_threshold_table`).


def _scale_values(fmt: FP4Format, device: torch.device) -> torch.Tensor:
    """The value of every scale byte [256] float32: E4M3 (nvfp4) or 2**(byte - 127) (mxfp4)."""
    byte = torch.arange(256, device=device)
    if fmt == NVFP4:
        return byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.exp2(byte.float() - _MX_BIAS)


def _e2m1_encode(x: torch.Tensor, mag: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., NB, B] of x [..., NB, B] (`mag` = |x|) given each block's 7 thresholds
    [7, ..., NB, 1] (`_threshold_table`): the magnitude index is how many thresholds |x| exceeds.
    Each comparison lands in one boolean buffer that is added to the codes as bytes (no
    conversions): 7 passes over the tensor, then the sign (bit 3)."""
    passed = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    codes = torch.gt(mag, thresholds[0]).view(torch.uint8)
    for t in thresholds[1:]:
        torch.gt(mag, t, out=passed)
        codes += passed.view(torch.uint8)
    torch.signbit(x, out=passed)
    return codes.add_(passed.view(torch.uint8), alpha=8)


@functools.lru_cache(maxsize=64)
def _threshold_table(fmt: FP4Format, global_scale: float, device: torch.device) -> torch.Tensor:
    """[7, 256 scale bytes]: the magnitudes an element must exceed to pass each E2M1 midpoint.

    Compares |x| with midpoint * unit instead of dividing: those products are exact in FP32
    (few significant bits), so ties are real ties and rounding never depends on division error.
    A tie moves up only past odd midpoints (to the even index above); there |x| >= m * unit is
    |x| > the float just below m * unit, so every test is one strict comparison.
    """
    unit = _scale_values(fmt, device) * torch.tensor(global_scale, dtype=torch.float32, device=device)  # [256]
    t = torch.tensor(_E2M1_MIDPOINTS, device=device)[:, None] * unit[None, :]  # [7, 256], exact
    odd = (torch.arange(7, device=device) % 2 == 1)[:, None]
    t = torch.where(odd, torch.nextafter(t, torch.zeros((), device=device)), t)
    return torch.where(unit > 0, t, torch.inf)  # a zero block scale encodes every element as (+-)0


def _block_thresholds(scales: torch.Tensor, global_scale: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    """Each block's 7 thresholds [7, ..., NB, 1], gathered from the tables of its global scale."""
    distinct, which = torch.unique(global_scale.reshape(-1), return_inverse=True)
    tables = [_threshold_table(fmt, g, scales.device) for g in distinct.tolist()]
    rows = scales.view(torch.uint8).to(torch.int32)  # [..., NB]
    if len(tables) > 1:
        rows += which.to(torch.int32).reshape(global_scale.shape) * 256
    table = tables[0] if len(tables) == 1 else torch.cat(tables, dim=1)
    return table.index_select(1, rows.reshape(-1)).reshape(7, *rows.shape, 1)


def _nvfp4_scales(block_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 block scales [..., NB] and power-of-two global scales [..., 1, 1] (see docstring)."""
    dims = _matrix_dims(block_amax.ndim)
    amax = block_amax.amax(dim=dims, keepdim=True)  # [..., 1, 1]
    # k = floor(log2(amax / 1296)), exactly: amax = mant * 2**exp and 1296 = 0.6328125 * 2**11
    mant, exp = torch.frexp(amax)
    k = (exp - 11 - (mant < 6 * _NV_TOP_SCALE_LOW / 2048).int()).clamp(_NV_K_MIN, _NV_K_MAX)
    global_scale = torch.exp2(k.float())  # exact for integer k

    ideal = (block_amax / global_scale / E2M1_MAX).clamp(max=E4M3_MAX)  # [..., NB]
    bits = ideal.to(torch.float8_e4m3fn).view(torch.uint8)
    unit = bits.view(torch.float8_e4m3fn).float() * global_scale
    # Scale rounded up so far (E4M3 subnormals only) that the block max would encode below 6:
    # step it one E4M3 code down so the max saturates to 6 and re-quantizing finds this scale.
    short = (block_amax <= 5 * unit) & (unit > 0)
    scales = torch.where(short, bits - 1, bits).view(torch.float8_e4m3fn)

    all_zero = (scales.float() == 0).all(dim=dims, keepdim=True)  # nothing to scale
    global_scale = torch.where(all_zero, 1.0, global_scale)
    return scales, global_scale


def _mxfp4_scales(block_amax: torch.Tensor) -> torch.Tensor:
    """E8M0 block scales [..., NB] as biased exponents: floor(log2(amax)) - 2, per OCP MX."""
    _, exp = torch.frexp(block_amax)  # block_amax = mant * 2**exp, mant in [0.5, 1)
    shared = (exp - 1 - 2).clamp(-_MX_BIAS, _MX_BIAS)
    shared = torch.where(block_amax > 0, shared, -_MX_BIAS)
    return (shared + _MX_BIAS).to(torch.uint8)


def quantize(x: torch.Tensor, fmt: FP4Format | str) -> QuantizedTensor:
    """Quantizes x [..., K] to FP4 along its last dim. K must divide into blocks."""
    fmt = get_format(fmt)
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a floating-point tensor, got {x.dtype}")
    _check_shape(x.shape, fmt)
    B = fmt.block_size
    x_blk = x.detach().float().unflatten(-1, (-1, B))  # [..., NB, B]
    mag = x_blk.abs()
    block_amax = mag.amax(dim=-1)  # [..., NB]
    if fmt == NVFP4:
        scales, global_scale = _nvfp4_scales(block_amax)
    else:
        scales = _mxfp4_scales(block_amax)
        global_scale = torch.ones(_global_shape(x.shape), device=x.device)
    thresholds = _block_thresholds(scales, global_scale, fmt)  # [7, ..., NB, 1]
    codes = _e2m1_encode(x_blk, mag, thresholds).flatten(-2)  # [..., K]
    return QuantizedTensor(codes, scales, global_scale, fmt, tuple(x.shape), x.dtype)


# --- decoding by table lookup ------------------------------------------------------------------------
#
# A block's values depend only on its scale byte (256 possible) and its codes, so decoding is a
# table lookup: per global scale, a table of every (scale byte, packed byte) pair's two values,
# computed once with the same float32 products as the formula, `E2M1_VALUES[code] * (scale *
# global_scale)`, then gathered by the index (table, scale byte, packed byte), two elements at a
# time. No per-element arithmetic (`flywheel bench fp4` measures it against the formula and
# `clone()`), and bit-identical to the formula.

_PAIR_INT = {1: torch.int16, 2: torch.int32, 4: torch.int64}  # two elements of a width, as one integer


@functools.lru_cache(maxsize=64)
def _value_table(fmt: FP4Format, global_scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256 scale bytes, 16 codes] values in `dtype`: E2M1_VALUES[code] * (scale * global_scale)."""
    unit = _scale_values(fmt, device) * torch.tensor(global_scale, dtype=torch.float32, device=device)  # [256]
    return (E2M1_VALUES.to(device)[None, :] * unit[:, None]).to(dtype)  # [256, 16]


@functools.lru_cache(maxsize=64)
def _pair_table(fmt: FP4Format, global_scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256 scale bytes * 256 packed bytes] of both elements' values, each pair as one integer."""
    v = _value_table(fmt, global_scale, dtype, device)  # [256, 16]
    byte = torch.arange(256, device=device)
    pairs = torch.stack((v[:, byte & 0xF], v[:, byte >> 4]), dim=-1)  # [256, 256, 2]: low nibble first
    return pairs.view(_PAIR_INT[dtype.itemsize]).reshape(-1)  # [65536]


def _lookup(
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    columns: torch.Tensor,
    fmt: FP4Format,
    dtype: torch.dtype,
    *,
    pairs: bool,
) -> torch.Tensor:
    """table[(global scale, scale byte, column)] for every element of `columns` [..., NB, C]: codes
    (C = B, the [256, 16] value tables) or packed bytes (pairs: C = B/2, the [256, 256] pair tables).
    Returns the values flat [numel(columns)]."""
    bits = 8 if pairs else 4
    distinct, which = torch.unique(global_scale.float().reshape(-1), return_inverse=True)
    make = _pair_table if pairs else _value_table
    tables = [make(fmt, g, dtype, columns.device).reshape(-1) for g in distinct.tolist()]
    rows = scales.view(torch.uint8).to(torch.int32) << bits  # [..., NB]
    if len(tables) > 1:  # one table per distinct global scale, one after the other
        rows += which.to(torch.int32).reshape(global_scale.shape) << (bits + 8)
    table = tables[0] if len(tables) == 1 else torch.cat(tables)
    if columns.device.type == "cpu":
        return _gather_cpu(table, rows.reshape(-1).numpy(), columns.contiguous().reshape(-1).numpy())
    index = columns.to(torch.int32)
    index.bitwise_or_(rows.unsqueeze(-1))
    return table.index_select(0, index.reshape(-1))


_GATHER_CHUNK = 1 << 18
"""Columns per gather on the CPU: the chunk's int32 index and its values (1 MiB each for bf16
pairs) are still in cache when the gather reads and writes them."""


def _gather_cpu(table: torch.Tensor, rows: np.ndarray, columns: np.ndarray) -> torch.Tensor:
    """table[rows[i // C] | columns[i]] [numel(columns)] for rows [NB] int32 and columns [NB * C].

    Chunk by chunk: the index is built by numpy (a widening, a repeat and an OR, where torch
    would run the OR as a broadcast over an inner dim of 8, element by element) and gathered by
    torch.index_select; both release the GIL, so chunks run on torch.get_num_threads() threads,
    handed out one at a time: on a shared machine a thread that loses its core does not hold
    the others up, as an even split (torch's intra-op threads) would."""
    per_row = columns.size // rows.size
    out = torch.empty(columns.size, dtype=table.dtype)
    step = max(1, _GATHER_CHUNK // per_row)  # rows per chunk

    def gather(r0: int) -> None:
        r1 = min(rows.size, r0 + step)
        index = columns[r0 * per_row : r1 * per_row].astype(np.int32)
        index |= np.repeat(rows[r0:r1], per_row)  # int32 | int32: numpy casts mixed types slowly
        torch.index_select(table, 0, torch.from_numpy(index), out=out[r0 * per_row : r1 * per_row])

    starts = range(0, rows.size, step)
    workers = min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for r0 in starts:
            gather(r0)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(gather, starts))
    return out


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decodes q to a dense tensor [..., K]: E2M1_VALUES[codes] * block scale * global scale, by
    table lookup. Exact in float32 and bfloat16 (see the module docstring)."""
    if dtype.itemsize not in _PAIR_INT:  # float64: the float32 values are exact in it
        return dequantize(q, torch.float32).to(dtype)
    codes = q.codes.unflatten(-1, (-1, q.fmt.block_size))  # [..., NB, B]
    return _lookup(q.scales, q.global_scale, codes, q.fmt, dtype, pairs=False).reshape(q.shape)


def decode(p: PackedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decodes a packed tensor to a dense one [..., K] straight from its bytes, two elements per
    lookup; equal to `dequantize(unpack(p), dtype)` bit for bit, and the fast way."""
    _check_packed(p)
    if dtype.itemsize not in _PAIR_INT:
        return decode(p, torch.float32).to(dtype)
    packed = p.weight_packed.unflatten(-1, (-1, p.fmt.block_size // 2))  # [..., NB, B/2]
    values = _lookup(p.weight_scale, _packed_global_scale(p), packed, p.fmt, dtype, pairs=True)
    return values.view(dtype).reshape(p.shape)


def quantize_dequantize(x: torch.Tensor, fmt: FP4Format | str) -> torch.Tensor:
    """Fake quantization: the FP4 value of every element, in x's dtype. No gradient."""
    return dequantize(quantize(x, fmt), dtype=x.dtype)


def fake_quantize(x: torch.Tensor, fmt: FP4Format | str) -> torch.Tensor:
    """Fake quantization with a straight-through estimator: value qdq(x), gradient identity.

    Written as qdq + (x - x.detach()) rather than x + (qdq - x).detach(): the added term is
    exactly zero, so the forward value is bit-identical to what packing would ship.
    """
    return quantize_dequantize(x.detach(), fmt) + (x - x.detach())


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packs codes [..., K] (uint8, 0..15) two a byte into [..., K/2]; low nibble = even element."""
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_codes needs uint8 codes with an even last dim, got {codes.dtype} {tuple(codes.shape)}")
    if codes.is_contiguous() and sys.byteorder == "little":
        # Each pair as one int16, even element in its low byte: its low byte shifted down by 4 is
        # empty (codes < 16), and its high byte lands in bits 4-7. Faster than strided halves.
        pairs = codes.view(torch.int16)
        return (pairs | (pairs >> 4)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_codes: [..., K/2] uint8 -> [..., K] uint8."""
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise ValueError(f"unpack_codes needs a uint8 tensor with at least 1 dim, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack(q: QuantizedTensor) -> PackedTensor:
    """The storage form of q: packed nibbles and compressed-tensors' global-scale convention."""
    lead = q.shape[:-2]
    global_div = (1.0 / q.global_scale).reshape(*lead, 1) if q.fmt == NVFP4 else None  # exact: power of two
    return PackedTensor(pack_codes(q.codes), q.scales, global_div, q.fmt, q.shape, q.dtype)


def _check_packed(p: PackedTensor) -> None:
    if p.weight_packed.shape[:-1] != tuple(p.shape[:-1]) or 2 * p.weight_packed.shape[-1] != p.shape[-1]:
        raise ValueError(f"weight_packed {tuple(p.weight_packed.shape)} does not match shape {p.shape}")
    if p.weight_packed.dtype != torch.uint8:
        raise ValueError(f"weight_packed must be uint8, got {p.weight_packed.dtype}")
    if p.weight_scale.shape != (*p.shape[:-1], p.shape[-1] // p.fmt.block_size):
        raise ValueError(f"weight_scale {tuple(p.weight_scale.shape)} does not match shape {p.shape} for {p.fmt.name}")
    if p.fmt == NVFP4 and p.weight_global_scale is None:
        raise ValueError("an nvfp4 PackedTensor needs weight_global_scale")


def _packed_global_scale(p: PackedTensor) -> torch.Tensor:
    """The global scale [..., 1, 1] (a multiplier, not compressed-tensors' divisor)."""
    if p.fmt == NVFP4:
        return (1.0 / p.weight_global_scale.float()).reshape(_global_shape(p.shape))
    return torch.ones(_global_shape(p.shape), device=p.weight_packed.device)


def unpack(p: PackedTensor) -> QuantizedTensor:
    """Inverse of pack."""
    _check_packed(p)
    return QuantizedTensor(
        unpack_codes(p.weight_packed), p.weight_scale, _packed_global_scale(p), p.fmt, p.shape, p.dtype
    )


def to_safetensors_dict(name: str, p: PackedTensor) -> dict[str, torch.Tensor]:
    """Tensors to save with safetensors, in compressed-tensors' layout (which vLLM loads).

    `name` is the module name, e.g. "model.layers.3.mlp.experts.5.gate_proj"; a trailing
    ".weight" is dropped, so a parameter name works too. For a weight [N, K]:

        {name}.weight_packed        uint8    [N, K/2]   two E2M1 codes a byte, low nibble = even column
        {name}.weight_scale         F8_E4M3  [N, K/16]  nvfp4 block scales
                                    uint8    [N, K/32]  mxfp4 E8M0 biased exponents (2**(e - 127))
        {name}.weight_global_scale  float32  [1]        nvfp4 only: 1 / global_scale, the divisor

    so weight = e2m1(codes) * weight_scale / weight_global_scale. Leading dims of a stacked
    tensor [..., N, K] carry over, with weight_global_scale [..., 1].
    """
    prefix = name.removesuffix(".weight")
    out = {
        f"{prefix}.weight_packed": p.weight_packed.contiguous(),
        f"{prefix}.weight_scale": p.weight_scale.contiguous(),
    }
    if p.weight_global_scale is not None:
        out[f"{prefix}.weight_global_scale"] = p.weight_global_scale.float().contiguous()
    return out


def from_safetensors_dict(
    tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype = torch.bfloat16
) -> PackedTensor:
    """Reads the layout of `to_safetensors_dict` back; the format follows from the scale dtype.

    The original dtype is not stored in that layout, so the caller names it (bf16 by default).
    """
    prefix = name.removesuffix(".weight")
    try:
        packed, scale = tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"]
    except KeyError as e:
        raise ValueError(f"no packed FP4 tensor {prefix!r}: missing {e.args[0]!r}") from None
    fmt = next((f for f in FORMATS.values() if f.scale_dtype == scale.dtype), None)
    shape = (*packed.shape[:-1], 2 * packed.shape[-1])
    if fmt is None or scale.shape != (*shape[:-1], shape[-1] // fmt.block_size):
        raise ValueError(
            f"{prefix}: weight_scale {scale.dtype} {tuple(scale.shape)} does not fit weight_packed "
            f"{tuple(packed.shape)} as nvfp4 (float8_e4m3fn, K/16) or mxfp4 (uint8, K/32)"
        )
    global_div = tensors.get(f"{prefix}.weight_global_scale")
    if fmt == NVFP4 and global_div is None:
        raise ValueError(f"{prefix}: nvfp4 needs {prefix}.weight_global_scale")
    return PackedTensor(packed, scale, global_div if fmt == NVFP4 else None, fmt, shape, dtype)


def packed_bits_per_weight(p: PackedTensor) -> float:
    """Storage bits per weight, scales included: about 4.5 for nvfp4 and 4.25 for mxfp4."""
    parts = [p.weight_packed, p.weight_scale] + ([p.weight_global_scale] if p.weight_global_scale is not None else [])
    return 8 * sum(t.numel() * t.element_size() for t in parts) / math.prod(p.shape)


# NVIDIA's NVFP4 recipe keeps the router, embeddings, norms, attention and lm_head in high
# precision; only the expert matmuls, where almost all MoE weights live, go to FP4.
DEFAULT_FP4_TARGETS: tuple[str, ...] = (
    r"(^|\.)mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$",  # per-expert Linear (HF checkpoint, vLLM)
    r"(^|\.)mlp\.experts\.(gate_up_proj|down_proj)$",  # fused experts [E, ., .] (transformers >= 5)
)


def is_fp4_target(param_name: str, patterns: Sequence[str] = DEFAULT_FP4_TARGETS) -> bool:
    """Whether a parameter is trained and shipped in FP4: any regex in `patterns` (re.search) matches.

    The model's FP4 hook is then `lambda name, w: fake_quantize(w, NVFP4) if is_fp4_target(name) else w`.
    """
    return any(re.search(p, param_name) for p in patterns)
