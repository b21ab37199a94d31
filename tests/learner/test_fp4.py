import dataclasses

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from learner.fp4 import (
    E2M1_VALUES,
    MXFP4,
    NVFP4,
    PackedTensor,
    decode,
    dequantize,
    fake_quantize,
    from_safetensors_dict,
    is_fp4_target,
    pack,
    pack_codes,
    packed_bits_per_weight,
    quantize,
    quantize_dequantize,
    to_safetensors_dict,
    unpack,
    unpack_codes,
)

FORMATS = [NVFP4, MXFP4]
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spread(*shape: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    """Gaussian rows, each times 10**u with u uniform in [lo, hi]: many magnitudes at once."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * 10 ** (lo + (hi - lo) * torch.rand(*shape[:-1], 1, generator=g))


def assert_same(q1, q2) -> None:
    assert torch.equal(q1.codes, q2.codes)
    assert torch.equal(q1.scales.view(torch.uint8), q2.scales.view(torch.uint8))
    assert torch.equal(q1.global_scale, q2.global_scale)
    assert (q1.fmt, q1.shape) == (q2.fmt, q2.shape)


def test_e2m1_value_set_and_encoding():
    assert sorted(set(E2M1_VALUES.abs().tolist())) == GRID
    assert E2M1_VALUES[:8].tolist() == GRID
    assert torch.equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])
    assert E2M1_VALUES[0b0111] == 6.0
    assert E2M1_VALUES[0b1000] == 0 and torch.signbit(E2M1_VALUES[0b1000])


@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_encode_to_their_codes(fmt):
    x = E2M1_VALUES.repeat(fmt.block_size // 16)  # [B], every code once per 16
    q = quantize(x, fmt)
    assert torch.equal(q.codes, torch.arange(16, dtype=torch.uint8).repeat(fmt.block_size // 16))
    assert torch.equal(dequantize(q, torch.float32), x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_round_trip_at_many_scales(fmt):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 8, fmt.block_size), generator=g)
    codes[..., 0] = 7  # every block holds a 6, so its scale is exactly 2**j
    # within one matrix j spans 2**16: NVFP4's E4M3 block scales reach from 2**8 down to 2**-9
    j = torch.randint(-8, 9, (4, 8, 1), generator=g).float()
    x = (E2M1_VALUES[codes] * torch.exp2(j)).flatten(-2)  # [4, 8 * B]
    assert torch.equal(quantize_dequantize(x, fmt), x)
    assert torch.equal(quantize_dequantize(x.bfloat16(), fmt), x.bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounds_to_nearest_ties_to_even_and_saturates(fmt):
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 0.3, 5.5]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.0, 0.5, 6.0]
    pad = fmt.block_size - len(ties)
    y = quantize_dequantize(torch.tensor(ties + [0.0] * pad), fmt)  # block max 6: one unit is 1.0
    assert y[: len(want)].tolist() == want
    assert torch.signbit(y[9])  # -0.25 -> -0
    # MX: shared exponent floor(log2(7)) - 2 = 0, so 7 saturates to 6 at unit scale
    q = quantize(torch.tensor([7.0] + [0.0] * 31), MXFP4)
    assert q.scales.tolist() == [127] and dequantize(q, torch.float32)[0] == 6.0


def test_mxfp4_shared_exponent_follows_ocp():
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0] = 0.3, 100.0, 1.0  # row 3 stays zero
    q = quantize(x, MXFP4)
    # floor(log2(amax)) - 2 + 127: 0.3 -> -2, 100 -> 6, 1 -> 0
    assert q.scales[:3, 0].tolist() == [123, 131, 125]
    assert q.global_scale.tolist() == [[1.0]]


def test_nvfp4_global_scale_is_a_power_of_two_in_the_window():
    for amax in [1e-30, 3e-7, 1.0, 1295.0, 1296.0, 2591.0, 2592.0, 7e4, 1e30]:
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
        x = x / x.abs().max() * amax
        q = quantize(x, NVFP4)
        mant, _ = torch.frexp(q.global_scale)
        assert mant.item() == 0.5, amax
        top = q.scales.float().max().item()
        assert 216 <= top < 432 and q.scales.float().max() <= 448, amax


def test_nvfp4_beats_mxfp4_on_gaussian_data():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    rel_mse = {fmt.name: (((quantize_dequantize(x, fmt) - x) ** 2).sum() / (x**2).sum()).item() for fmt in FORMATS}
    assert rel_mse["nvfp4"] < rel_mse["mxfp4"]
    assert rel_mse["nvfp4"] < 0.011 and rel_mse["mxfp4"] < 0.015  # measured 0.0091 and 0.0132


@pytest.mark.parametrize("fmt, bits", [(NVFP4, 4.5), (MXFP4, 4.25)])
def test_packed_size(fmt, bits):
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    p = pack(quantize(x, fmt))
    assert p.weight_packed.shape == (256, 512) and p.weight_packed.dtype == torch.uint8
    assert p.weight_scale.shape == (256, 1024 // fmt.block_size)
    assert bits <= packed_bits_per_weight(p) < bits + 0.001
    file_bits = 8 * len(st_save(to_safetensors_dict("w", p))) / x.numel()
    assert bits < file_bits < bits + 0.01  # plus the safetensors header


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lo, hi", [(-37, -30), (-8, 0), (-3, 3), (0, 8), (30, 37)])
def test_dequantized_values_are_exact_in_bf16(fmt, lo, hi):
    x = spread(16, 128, lo=lo, hi=hi)
    q = quantize(x, fmt)
    y = dequantize(q, torch.float32)
    assert torch.isfinite(y).all()
    assert torch.equal(y.bfloat16().float(), y)
    assert torch.equal(dequantize(q, torch.bfloat16).float(), y)
    assert (y != 0).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, lo, hi", [((32, 256), -3, 3), ((3, 8, 64), -12, 0), ((64,), 0, 1), ((8, 64), 30, 37)])
def test_requantizing_dequantized_weights_is_bit_identical(fmt, shape, lo, hi):
    q = quantize(spread(*shape, lo=lo, hi=hi), fmt)
    for dtype in (torch.bfloat16, torch.float32):
        assert_same(quantize(dequantize(q, dtype), fmt), q)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("amax", [3e38, 1e-33, 1e-40])  # past the global-scale clamps; fp32 subnormals
def test_extreme_magnitudes_stay_finite_exact_and_round_trip(fmt, amax):
    x = spread(8, 64, lo=-2, hi=0)
    q = quantize(x / x.abs().max() * amax, fmt)
    y = dequantize(q, torch.float32)
    assert torch.isfinite(y).all()
    assert torch.equal(y.bfloat16().float(), y)
    assert_same(quantize(dequantize(q), fmt), q)


def test_requantize_covers_e4m3_subnormal_scales():
    x = torch.zeros(2, 16)
    x[0, 0] = 6.0  # global scale 2**-8, block scale 256: one unit is 1.0
    x[1, 0] = 6 * 1.6 * 2**-9 * 2**-8  # ideal block scale 1.6 * 2**-9 would round up to 2 * 2**-9
    q = quantize(x, NVFP4)
    assert q.global_scale.item() == 2**-8
    assert q.scales.view(torch.uint8).tolist() == [[0x78], [1]]  # 256 = 1.0 * 2**8; 2**-9, stepped down
    assert dequantize(q, torch.float32)[1, 0].item() == 6 * 2**-9 * 2**-8  # the max saturates to 6
    assert_same(quantize(dequantize(q), NVFP4), q)
    # and across a whole tensor whose small rows land in E4M3 subnormals
    q = quantize(spread(64, 64, lo=-9, hi=0, seed=3), NVFP4)
    assert ((q.scales.float() > 0) & (q.scales.float() < 2**-6)).any()
    assert_same(quantize(dequantize(q), NVFP4), q)


def test_pack_codes_nibble_order_and_round_trip():
    assert pack_codes(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    for shape in [(3, 5, 64), (512, 4096)]:  # the large one takes the vectorized loops
        codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        assert torch.equal(pack_codes(codes), codes[..., 0::2] | (codes[..., 1::2] << 4))
        assert torch.equal(unpack_codes(pack_codes(codes)), codes)
    strided = torch.arange(32, dtype=torch.uint8).reshape(4, 8).T % 16  # not contiguous
    assert torch.equal(pack_codes(strided), pack_codes(strided.contiguous()))


def formula(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, fmt) -> torch.Tensor:
    """The documented decoding, element by element in float32: e2m1(code) * scale * global_scale."""
    unit = scales.float() * global_scale if fmt == NVFP4 else torch.exp2(scales.int().float() - 127)
    values = E2M1_VALUES[codes.long()].unflatten(-1, (-1, fmt.block_size))
    return (values * unit.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_table_decoding_matches_the_formula_for_every_byte_and_scale(fmt, dtype):
    # row r of each matrix: all 256 packed bytes, every block with scale byte r (NaN scales too),
    # so each [scale, byte] entry of the tables is checked; two matrices, two global scales
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 256, 1)  # [2, 256, 256]
    nb = 512 // fmt.block_size
    scale_bytes = torch.arange(256, dtype=torch.uint8)[None, :, None].expand(2, 256, nb).contiguous()
    scales = scale_bytes.view(fmt.scale_dtype) if fmt == NVFP4 else scale_bytes
    glob = torch.tensor([2.0**-8, 2.0**5]).reshape(2, 1, 1) if fmt == NVFP4 else torch.ones(2, 1, 1)
    shape = (2, 256, 512)
    p = PackedTensor(packed, scales, (1 / glob).reshape(2, 1) if fmt == NVFP4 else None, fmt, shape, dtype)
    want = formula(unpack_codes(packed), scales, glob, fmt).to(dtype)
    for got in (decode(p, dtype), dequantize(unpack(p), dtype)):
        assert got.dtype == dtype and got.shape == shape
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all() and torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_dequantize_of_unpack(fmt):
    x = spread(3, 16, 64, lo=-30, hi=30, seed=6)  # stacked experts, each its own global scale
    p = pack(quantize(x, fmt))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(decode(p, dtype), dequantize(unpack(p), dtype))
        assert torch.equal(decode(p, dtype), quantize_dequantize(x, fmt).to(dtype))
    vector = pack(quantize(spread(1, 128, lo=-1, hi=1)[0], fmt))
    assert torch.equal(decode(vector), dequantize(unpack(vector)))


def reference_codes(x: torch.Tensor, fmt) -> torch.Tensor:
    """E2M1 codes by the rule itself: 7 comparisons of |x| with midpoint * unit, > at even
    midpoints (a tie stays on the even index) and >= at odd ones, given quantize's scales."""
    q = quantize(x, fmt)
    unit = formula(torch.full_like(q.codes, 2), q.scales, q.global_scale, fmt)  # E2M1 code 2 is 1.0
    mag = x.float().abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8)
    for i, m in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        idx += (mag > m * unit) if i % 2 == 0 else (mag >= m * unit)
    return torch.where(unit > 0, idx, 0) | (torch.signbit(x).to(torch.uint8) << 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_follows_the_rounding_rule_at_every_tie(fmt):
    g = torch.Generator().manual_seed(7)
    x = spread(8, 256, lo=-20, hi=20, seed=8)
    # every tie and grid point, at block scales 2**j: the block max 6 fixes the scale
    ties = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 5.5, 6.0])
    block = torch.cat([torch.tensor([6.0]), ties[torch.randint(0, 15, (fmt.block_size - 1,), generator=g)]])
    signs = torch.where(torch.rand(16, 4, fmt.block_size, generator=g) < 0.5, -1.0, 1.0)
    tied = (block * signs * torch.exp2(torch.randint(-6, 7, (16, 4, 1), generator=g).float())).flatten(-2)
    for data in (x, tied, x.bfloat16()):
        assert torch.equal(quantize(data, fmt).codes, reference_codes(data, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_unpack_and_safetensors_round_trip(fmt):
    x = spread(3, 16, 64, lo=-2, hi=2).bfloat16()  # stacked experts [E, N, K]
    q = quantize(x, fmt)
    assert_same(unpack(pack(q)), q)
    tensors = st_load(st_save(to_safetensors_dict("model.layers.0.mlp.experts.1.up_proj.weight", pack(q))))
    prefix = "model.layers.0.mlp.experts.1.up_proj"
    p = from_safetensors_dict(tensors, prefix + ".weight")
    assert p.fmt == fmt and p.shape == x.shape and p.dtype == torch.bfloat16
    assert_same(unpack(p), q)
    assert torch.equal(dequantize(unpack(p)), quantize_dequantize(x, fmt))
    if fmt == NVFP4:
        assert set(tensors) == {prefix + s for s in (".weight_packed", ".weight_scale", ".weight_global_scale")}
        assert tensors[prefix + ".weight_scale"].dtype == torch.float8_e4m3fn
        # compressed-tensors convention: the stored global scale is the divisor
        assert torch.equal(tensors[prefix + ".weight_global_scale"], 1 / q.global_scale.reshape(3, 1))
    else:
        assert set(tensors) == {prefix + s for s in (".weight_packed", ".weight_scale")}
        assert tensors[prefix + ".weight_scale"].dtype == torch.uint8


def test_safetensors_layout_decodes_by_its_documented_formula():
    x = spread(8, 32, lo=-1, hi=1)
    t = to_safetensors_dict("w", pack(quantize(x, NVFP4)))
    packed = t["w.weight_packed"]
    codes = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2)  # low nibble = even column
    scale = t["w.weight_scale"].float().repeat_interleave(16, dim=-1)
    y = E2M1_VALUES[codes.long()] * scale / t["w.weight_global_scale"]
    assert torch.equal(y, quantize_dequantize(x, NVFP4))


def test_one_global_scale_per_matrix():
    x = torch.stack([torch.randn(8, 32), 1000 * torch.randn(8, 32)])  # [E=2, N, K]
    q = quantize(x, NVFP4)
    assert q.global_scale.shape == (2, 1, 1)
    for e in range(2):
        alone = quantize(x[e], NVFP4)
        assert torch.equal(q.codes[e], alone.codes)
        assert torch.equal(q.global_scale[e], alone.global_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_straight_through(dtype):
    x = spread(4, 32, lo=-1, hi=1).to(dtype).requires_grad_()
    y = fake_quantize(x, NVFP4)
    assert y.dtype == dtype
    assert torch.equal(y.detach(), quantize_dequantize(x.detach(), NVFP4))
    assert not torch.equal(y.detach(), x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_tensor_and_zero_block_give_no_nan(fmt):
    q = quantize(torch.zeros(4, 64), fmt)
    y = dequantize(q, torch.float32)
    assert torch.equal(y, torch.zeros(4, 64))
    assert (q.scales.float() == 0).all() if fmt == NVFP4 else (q.scales == 0).all()
    assert (q.global_scale == 1).all()
    assert_same(quantize(dequantize(q), fmt), q)

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    x[1, : fmt.block_size] = 0
    y = quantize_dequantize(x, fmt)
    assert not torch.isnan(y).any()
    assert (y[1, : fmt.block_size] == 0).all() and (y[0] != 0).any()


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="divisible by 16"):
        quantize(torch.randn(4, 24), NVFP4)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError):
        quantize(torch.tensor(1.0), NVFP4)
    with pytest.raises(ValueError):
        quantize(torch.zeros(0, 16), NVFP4)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(2, 16, dtype=torch.int32), NVFP4)
    with pytest.raises(ValueError, match="unknown FP4 format"):
        quantize(torch.randn(2, 16), "int4")
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="missing"):
        from_safetensors_dict({}, "w")


def test_default_fp4_targets_are_the_expert_weights_only():
    for layer in (0, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert is_fp4_target(f"model.layers.{layer}.mlp.experts.5.{proj}.weight")
    assert is_fp4_target("model.layers.3.mlp.experts.gate_up_proj")  # fused experts
    for name in [
        "model.layers.3.mlp.gate.weight",  # router
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.mlp.shared_expert.gate_proj.weight",
    ]:
        assert not is_fp4_target(name), name
    assert is_fp4_target("model.layers.3.self_attn.q_proj.weight", [r"self_attn\.\w+_proj\.weight$"])
    assert not is_fp4_target("model.layers.3.mlp.experts.5.up_proj.weight", [])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("chunk", [1, 8, 24, 1000])
def test_decode_in_chunks_on_threads_matches_the_formula(fmt, chunk, monkeypatch):
    # chunks of 1 row of blocks up to many (and one that does not divide the rows), gathered on 3
    # threads: every chunk boundary lands on the right block scale and the right global scale
    monkeypatch.setattr("learner.fp4._GATHER_CHUNK", chunk * fmt.block_size // 2)
    x = spread(3, 40, 256, lo=-20, hi=20, seed=9)  # stacked experts: 3 global scales (nvfp4)
    p = pack(quantize(x, fmt))
    glob = (1 / p.weight_global_scale).reshape(3, 1, 1) if fmt == NVFP4 else torch.ones(3, 1, 1)
    want = formula(unpack_codes(p.weight_packed), p.weight_scale, glob, fmt)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(decode(p, dtype).view(torch.uint8), want.to(dtype).view(torch.uint8))
            assert torch.equal(dequantize(unpack(p), dtype).view(torch.uint8), want.to(dtype).view(torch.uint8))
        strided = dataclasses.replace(p, weight_packed=p.weight_packed.mT.contiguous().mT)  # not contiguous
        assert torch.equal(decode(strided).view(torch.uint8), want.bfloat16().view(torch.uint8))
    finally:
        torch.set_num_threads(threads)
