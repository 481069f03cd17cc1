"""The fused CPU elementwise kernels (engine/cpu/fused.cpp) against the eager PyTorch ops they replace:
RoPE in place (partial rotary included) and SiLU(gate) * up bit for bit in fp32 and bf16; residual add + RMSNorm
(HF Llama's arithmetic) bit for bit in fp32, and in bf16 with the stream exact and the norm off only at rare
rounding boundaries.
Then whole models with the kernels against the same models without them (the extension hidden from the
loader): fp32 identical down to the logprobs, bf16 the same greedy tokens. bf16 against HF's own
bf16 model is tests/test_moe.py::test_bf16_greedy_matches_hf_bf16 (Phi-3 and the MoE families, kernels on)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention import cpu_native
from engine.models import loader
from engine.models.decoder import RMSNorm, apply_rope, fp32_norm_lanes
from tiny_models import build

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="the CPU extension does not build here")


@pytest.fixture(params=cpu_native.isas())
def kernels(request):
    """The kernels built for each instruction-set level this CPU runs (avx512, avx2, default): each path is
    tested here, not only the one the engine picks."""
    built = cpu_native.load(request.param)
    assert built is not None and built.isa == request.param
    return built


def same_level_as_torch(kernels) -> bool:
    """Whether PyTorch's own CPU kernels run at the build's level in this process (ATEN_CPU_CAPABILITY): SiLU is
    bit for bit PyTorch's only then (the same vector exp, the same scalar tail); .ci/run runs these tests again
    with ATEN_CPU_CAPABILITY=avx2 so that level is checked bit for bit too."""
    return kernels.isa == cpu_native.current_isa()
SHAPES = [(1, 576), (64, 576), (300, 960), (2048, 64), (512, 4096)]


def bf16(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows,dim", SHAPES)
def test_rms_norm_and_residual_add_equal_eager_bf16(kernels, rows, dim):
    norm = RMSNorm(dim, 1e-6).to(torch.bfloat16)
    norm.weight.data = bf16(dim, seed=1)
    x, residual = bf16(rows, dim, scale=4.0, seed=2), bf16(rows, dim, seed=3)
    [out] = kernels.rms_norm(x, None, norm.weight, norm.eps)
    assert_within_one_ulp(out, norm(x))
    out, stream = kernels.rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(stream, x + residual)
    assert_within_one_ulp(out, norm(x + residual))


def assert_within_one_ulp(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 outputs equal except at rounding boundaries, at most 1e-4 of them (the fp32 sum of squares is summed
    in another order than PyTorch's, see fused.cpp): the normalised value 1 bf16 ulp off, which after the
    weight's multiply and rounding is at most 2 ulps of the output."""
    ref = ref.detach()
    ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), torch.frexp(ref.float()).exponent - 8)
    assert ((out.float() - ref.float()).abs() <= 2 * ulp).all()
    assert (out != ref).float().mean().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_silu_mul_equals_eager(kernels, rows, dim, dtype):
    """Bit for bit where PyTorch runs at the build's level. At another level the exp differs (Sleef's 16- or
    8-lane u10 exp, or glibc's scalar expf, each within 1 ulp) and so may where a row's scalar tail starts:
    x / (1 + e) * up is then off by at most ~3 fp32 ulps (1 from exp, 1/2 each from the division and the
    multiply, the 1 + e add only shrinks e's error); in bf16 SiLU(gate) rounds to a neighbouring bf16 at most,
    so the product is within 2 bf16 ulps."""
    gate_up = bf16(rows, 2 * dim, scale=3.0).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out, want = kernels.silu_mul(gate_up), F.silu(gate).mul_(up)
    if same_level_as_torch(kernels):
        assert torch.equal(out, want)
    elif dtype == torch.float32:
        assert_within_ulps(out, want, 3, mantissa_bits=24)
    else:
        assert_within_ulps(out, want, 2, mantissa_bits=8)


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: int, mantissa_bits: int) -> None:
    ref = ref.detach().float()
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - mantissa_bits)
    assert ((out.float() - ref).abs() <= ulps * ulp).all()


def test_silu_mul_bf16_every_gate_value(kernels):
    """The bf16 kernel looks SiLU up in a table over all 65,536 bf16 values: every one of them as a gate (NaNs,
    infinities, subnormals, both zeros included) against eager, bit for bit wherever eager's result is a number,
    with a 1.5 up and a random up; a width of 65,542 also runs the masked tail."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = torch.cat([gate, gate[:6]])
    for up in (torch.full_like(gate, 1.5), torch.randn(gate.shape, generator=torch.Generator().manual_seed(0))
               .to(torch.bfloat16)):
        out = kernels.silu_mul(torch.cat([gate, up]).view(1, -1))[0]
        want = F.silu(gate.view(1, -1)).mul_(up.view(1, -1))[0]
        nan = want.isnan()  # NaN out where eager has NaN (the kernel stores the one NaN c10::BFloat16 rounds to)
        assert torch.equal(out.isnan(), nan)
        if same_level_as_torch(kernels):
            assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
        else:  # another exp (see test_silu_mul_equals_eager): a neighbouring bf16 at most, infinities alike
            assert torch.equal(out[~nan].isinf(), want[~nan].isinf())
            finite = ~nan & ~want.isinf()
            assert_within_ulps(out[finite], want[finite], 2, mantissa_bits=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,half", [(9, 3, 64, 32), (4, 1, 32, 16), (4, 2, 16, 4)])
def test_rope_in_place_equals_apply_rope(kernels, dtype, heads, kv_heads, head_dim, half):
    """q and k heads rotated inside the fused qkv row; the v columns untouched; half < head_dim / 2 is
    partial rotary (Phi-4-mini): the remaining dims pass through."""
    tokens = 37
    qkv = bf16(tokens, (heads + 2 * kv_heads) * head_dim, seed=4).to(dtype)
    cos, sin = bf16(tokens, half, seed=5).to(dtype), bf16(tokens, half, seed=6).to(dtype)
    width = (heads + kv_heads) * head_dim
    expected = apply_rope(qkv[:, :width].view(tokens, -1, head_dim), cos[:, None], sin[:, None])
    out = qkv.clone()
    kernels.rope_(out, cos, sin, heads + kv_heads, head_dim)
    assert torch.equal(out[:, :width].view(tokens, -1, head_dim), expected)
    assert torch.equal(out[:, width:], qkv[:, width:])


FP32_DIMS = [1, 7, 16, 17, 64, 100, 576, 896, 960, 2048, 2304, 4096, 65536]


@pytest.mark.parametrize("dim", FP32_DIMS)
def test_fp32_rms_norm_and_residual_add_equal_torch_bit_for_bit(kernels, dim):
    """Oracle: F.rms_norm itself (what RMSNorm runs in fp32, and HF's arithmetic). The kernel sums the squares
    in PyTorch's order at the vector width fp32_norm_lanes found; every output bit must match, at scales where
    the sum's rounding decides many bits, across row widths that take every branch of PyTorch's cascade
    (no whole vector, a tail, remainders of the 4-vector rows, several cascade levels)."""
    lanes = fp32_norm_lanes(kernels, 576, 1e-5)
    assert lanes in (8, 16), "neither lane count reproduces this PyTorch's fp32 RMSNorm"
    g = torch.Generator().manual_seed(dim)
    for scale in (1e-3, 1.0, 30.0):
        x, residual = torch.randn(65, dim, generator=g) * scale, torch.randn(65, dim, generator=g) * scale
        w = torch.randn(dim, generator=g)
        [out] = kernels.rms_norm_f32(x, None, w, 1e-6, lanes)
        assert torch.equal(out, F.rms_norm(x, (dim,), w, 1e-6))
        out, stream = kernels.rms_norm_f32(x, residual, w, 1e-5, lanes)
        assert torch.equal(stream, x + residual)
        assert torch.equal(out, F.rms_norm(x + residual, (dim,), w, 1e-5))
    other = 24 - lanes  # the other width sums in another order: the check above can tell the two apart
    x = torch.randn(65, max(dim, 64), generator=g)
    w = torch.ones(x.shape[1])
    assert not torch.equal(kernels.rms_norm_f32(x, None, w, 1e-6, other)[0], F.rms_norm(x, (x.shape[1],), w, 1e-6))


def test_bad_inputs_are_refused_with_the_reason(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm_f32(bf16(4, 8), None, bf16(8), 1e-6, 8)
    with pytest.raises(RuntimeError, match="lanes"):
        kernels.rms_norm_f32(torch.randn(4, 8), None, torch.randn(8), 1e-6, 4)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        kernels.rms_norm(torch.randn(4, 8), None, torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        kernels.silu_mul(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(bf16(8, 4).t(), None, bf16(8), 1e-6)
    with pytest.raises(RuntimeError, match="narrower"):
        kernels.rope_(torch.randn(2, 8), torch.randn(2, 2), torch.randn(2, 2), 4, 4)


def generate(path, dtype: str, monkeypatch, fused: bool):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(loader, "cpu_native", types.SimpleNamespace(load=lambda: None))
        llm = LLM(str(path), dtype=dtype, block_size=4, max_num_batched_tokens=16)
        model = llm.engine.runner.model
        used = (model.layers[0].self_attn.rope_kernel is not None, model.norm_kernel is not None,
                model.layers[0].mlp.kernel is not None)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = llm.generate([[5, 9, 33, 2, 71, 14, 9, 8, 100, 3] * 3, [17, 4, 4, 250]], params)
    return used, [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_kernels_equals_model_without(family, dtype, tmp_path, monkeypatch):
    """Chunked prefill (16-token budget) and decode: the fused ops change nothing, down to the logprobs.
    Phi-3's tiny checkpoint has random norm weights and partial rotary dims."""
    path, _ = build(family, tmp_path)
    used, fused = generate(path, dtype, monkeypatch, fused=True)
    assert used == (True, True, True)
    unused, eager = generate(path, dtype, monkeypatch, fused=False)
    assert unused == (False, False, False)
    if dtype == "float32":
        assert fused == eager
    else:
        assert [ids for ids, _ in fused] == [ids for ids, _ in eager]
        for (_, a), (_, b) in zip(fused, eager):
            assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], abs=0.05)
