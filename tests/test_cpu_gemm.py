"""Tandem's CPU GEMM (engine/cpu/gemm.cpp) against an fp64 reference, and the packed linears choosing
it (engine/cpu/linear.py). Whole models through it against Hugging Face are tests/test_real_model.py,
test_correctness_hf.py and test_model_families.py (fp32 greedy token for token) and tests/test_moe.py (bf16).

Every check runs against each instruction-set level's build this CPU can run (cpu_native.isas(): the AVX-512
intrinsics, and the portable path compiled for AVX2 and for SSE2), the packed linears made to pick that build.

The bound: any order of fp32 sums of K exact products is within gamma_K = K u / (1 - K u) (u = 2^-24) of the
exact result, relative to sum |x| |w| (+ |bias|); bf16 products are exact in fp32, and a bf16 output adds one
rounding (2^-8 relative). A dropped term, a wrong column or a missed tail is far outside it. Where every sum is
exact in fp32 (small integers), the outputs are exact: fp32 equal, bf16 the one c10::BFloat16 rounding of it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_native
from engine.models import cpu_linear


pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="the CPU extension does not build here")


@pytest.fixture(scope="module", params=cpu_native.isas())
def kernels(request):
    """The build of one level (the test id names it): where this CPU's own level builds, every level must."""
    module = cpu_native.load(request.param)
    assert module is not None and module.isa == request.param
    return module


@pytest.fixture(autouse=True)
def linears_use_the_level(kernels, monkeypatch):
    """cpu_linear asks cpu_native.load() (PyTorch's level) for its kernels: here, the level under test."""
    monkeypatch.setattr(cpu_native, "load", lambda isa=None: kernels)


def need(kernels, dtype: torch.dtype) -> None:
    if str(dtype).removeprefix("torch.") not in kernels.gemm_dtypes:
        pytest.skip(f"no {dtype} GEMM in the {kernels.isa} build on this CPU")


dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def test_every_level_has_both_dtypes_and_the_fused_silu(kernels):
    """The portable path (avx2, default) everywhere; AVX-512 without AVX512-BF16 is fp32 only."""
    if kernels.isa != "avx512" or "avx512_bf16" in cpu_native._cpu_flags():
        assert kernels.gemm_dtypes == ("float32", "bfloat16")
    assert kernels.gemm_silu


def within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    u = 2.0 ** -24
    k = x.shape[-1] + 1  # + 1: the bias add
    bound = k * u / (1 - k * u) * scale
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (exact.abs() + bound)
    err = (y.double() - exact).abs()
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3g}"


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# rows: 1 (decode), the 8-row blocks' tails, 16 and several blocks; columns around the 48-wide panels; K small,
# odd and a model's.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 70])
@pytest.mark.parametrize("out_features,in_features", [(1, 5), (47, 64), (48, 33), (49, 576), (200, 7), (1000, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
@dtypes
def test_linear_within_the_summation_bound(kernels, rows, out_features, in_features, with_bias, dtype):
    need(kernels, dtype)
    w, x = randn(out_features, in_features, seed=1, dtype=dtype), randn(rows, in_features, seed=2, dtype=dtype)
    bias = randn(out_features, seed=3, dtype=dtype) if with_bias else None
    y = kernels.gemm_linear(x, kernels.gemm_pack(w), None if bias is None else bias.float(), out_features)
    within_bound(y, x, w, bias)


@dtypes
def test_linear_exact_where_the_sums_are(kernels, dtype):
    """Small integers: every product and partial sum exact in fp32, whatever the order, so fp32 outputs are exact
    and bf16 ones c10::BFloat16's rounding of them (odd integers past 256 are ties, the bias's 2^-9 moves some off
    them); a NaN weight gives its column c10's NaN (0x7FC0)."""
    need(kernels, dtype)
    gen = torch.Generator().manual_seed(5)
    for rows, out_features, in_features in [(1, 50, 64), (9, 97, 33), (17, 200, 576)]:
        w = torch.randint(-4, 5, (out_features, in_features), generator=gen).to(dtype)
        x = torch.randint(-4, 5, (rows, in_features), generator=gen).to(dtype)
        bias = torch.randint(-64, 65, (out_features,), generator=gen).float() * 0.25 + 2.0 ** -9 * torch.randint(
            0, 2, (out_features,), generator=gen).float()
        w[out_features // 2, in_features // 3] = float("nan")
        exact = torch.addmm(bias.double(), x.double(), w.double().T).float()  # exact in fp32 (< 2^14 in steps of 2^-9)
        y = kernels.gemm_linear(x, kernels.gemm_pack(w), bias, out_features)
        if dtype == torch.float32:
            assert torch.equal(y.isnan(), exact.isnan()) and torch.equal(y.nan_to_num(), exact.nan_to_num())
        else:  # c10::BFloat16's rounding of the fp32 value: nearest, ties to even, NaN -> 0x7FC0 (the vectorized
            # .to(bfloat16) writes NaNs as 0xFFFF: compared apart)
            nan = exact.isnan()
            assert torch.equal(y.isnan(), nan) and (y[nan].view(torch.int16) == 0x7FC0).all()
            assert torch.equal(y[~nan].view(torch.int16), exact[~nan].to(torch.bfloat16).view(torch.int16))


@dtypes
def test_linear_leading_dims_strided_input_and_no_rows(kernels, dtype):
    need(kernels, dtype)
    w = randn(100, 65, seed=1, dtype=dtype)
    packed = kernels.gemm_pack(w)
    x = randn(2, 5, 65, seed=2, dtype=dtype)
    y = kernels.gemm_linear(x, packed, None, 100)
    assert y.shape == (2, 5, 100)
    within_bound(y, x, w, None)
    xt = randn(65, 7, seed=4, dtype=dtype).t()  # not contiguous
    within_bound(kernels.gemm_linear(xt, packed, None, 100), xt, w, None)
    assert kernels.gemm_linear(torch.empty(0, 65, dtype=dtype), packed, None, 100).shape == (0, 100)
    assert kernels.gemm_linear(x, kernels.gemm_pack(torch.empty(0, 65, dtype=dtype)), None, 0).shape == (2, 5, 0)


@dtypes
def test_a_row_is_the_same_bits_in_any_block_of_rows(kernels, dtype):
    """Each output is one chain of multiply-adds over k in order, whichever pass of the micro-kernel computes its
    row (at the portable levels a block of 2-8 rows goes as whole-panel and half-panel passes of a few rows): a
    row of x alone and the same row among 2-17 others give the same bits, with and without bias."""
    need(kernels, dtype)
    for n, k in ((100, 37), (49, 576), (1000, 96)):
        w, bias = randn(n, k, seed=n, dtype=dtype), randn(n, seed=n + 1)
        packed = kernels.gemm_pack(w)
        for rows in range(2, 18):
            x = randn(rows, k, seed=rows, dtype=dtype)
            for b in (None, bias):
                y = kernels.gemm_linear(x, packed, b, n)
                for i in range(rows):
                    assert torch.equal(y[i:i + 1], kernels.gemm_linear(x[i:i + 1], packed, b, n)), (n, k, rows, i)


@dtypes
def test_same_bits_however_the_work_is_split(kernels, dtype):
    """12 panels (576 columns, a model's o_proj) on 1-8 threads: by panels alone, or by panels and rows."""
    need(kernels, dtype)
    w, x = randn(576, 64, seed=1, dtype=dtype), randn(70, 64, seed=2, dtype=dtype)
    packed, threads = kernels.gemm_pack(w), torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 7, 8):
            torch.set_num_threads(n)
            outs.append(kernels.gemm_linear(x, packed, None, 576))
    finally:
        torch.set_num_threads(threads)
    within_bound(outs[0], x, w, None)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@dtypes
def test_pack_layout_and_zero_padding(kernels, dtype):
    need(kernels, dtype)
    w = randn(50, 3, seed=1, dtype=dtype)
    packed = kernels.gemm_pack(w)
    if dtype == torch.float32:
        assert packed.shape == (2, 3, 48)
        assert torch.equal(packed[0], w[:48].T) and torch.equal(packed[1, :, :2], w[48:].T)
        assert not packed[1, :, 2:].any()
    else:  # pairs of k: [panel, k // 2, column, k % 2], the 4th k of 3 zero
        assert packed.shape == (2, 2, 48, 2)
        for k in range(3):
            assert torch.equal(packed[0, k // 2, :, k % 2], w[:48, k])
            assert torch.equal(packed[1, k // 2, :2, k % 2], w[48:, k])
        assert not packed[:, 1, :, 1].any() and not packed[1, :, 2:].any()


def test_bad_inputs_are_refused_with_the_reason(kernels):
    packed = kernels.gemm_pack(randn(10, 8, seed=1))
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        kernels.gemm_linear(randn(2, 9, seed=2), packed, None, 10)
    with pytest.raises(RuntimeError, match="x is BFloat16, the weight Float"):
        kernels.gemm_linear(randn(2, 8, seed=2).bfloat16(), packed, None, 10)
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.gemm_linear(randn(2, 8, seed=2), packed, None, 60)
    with pytest.raises(RuntimeError, match="float32 bias of 10 values, got Float of 9"):
        kernels.gemm_linear(randn(2, 8, seed=2), packed, randn(9, seed=3), 10)
    with pytest.raises(RuntimeError, match="float32 bias of 10 values, got BFloat16 of 10"):
        kernels.gemm_linear(randn(2, 8, seed=2), packed, randn(10, seed=3).bfloat16(), 10)
    with pytest.raises(RuntimeError, match="not a gemm_pack result"):
        kernels.gemm_linear(randn(2, 8, seed=2), randn(10, 8, seed=1), None, 10)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.gemm_pack(randn(10, 8, seed=1).double())


@dtypes
def test_packed_linear_picks_tandem_gemm_and_onednn_without_it(kernels, dtype, monkeypatch):
    need(kernels, dtype)
    linear = nn.Linear(64, 100).to(dtype)
    x = randn(5, 64, seed=2, dtype=dtype)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    packed = cpu_linear.PackedLinear(linear)
    assert isinstance(packed.packed, cpu_linear.Panels) and "tandem gemm" in packed.extra_repr()
    within_bound(packed(x), x, weight, bias)
    monkeypatch.setenv("TANDEM_CPU_GEMM", "0")
    if not cpu_linear.onednn_runs(dtype):  # bf16 below AVX-512: nothing packs it, so the loader leaves it plain
        assert not cpu_linear.available(dtype)
        with pytest.raises(ValueError, match="oneDNN does not run"):
            cpu_linear.PackedLinear(linear)
        return
    onednn = cpu_linear.PackedLinear(linear)
    assert not isinstance(onednn.packed, cpu_linear.Panels) and "onednn" in onednn.extra_repr()
    within_bound(onednn(x), x, weight, bias)


# ---- gate/up with SiLU(gate) * up in the GEMM's epilogue (gemm_silu_mul, cpu_linear.FusedGateUp) ----------------
def eager_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """What the eager MLP computes from a [gate, up] output: SiLU in the tensor's dtype, then the multiply."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 70])
@pytest.mark.parametrize("inter,in_features", [(32, 5), (64, 576), (96, 33), (1536, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@dtypes
def test_fused_silu_mul_is_eager_silu_on_the_gemm_output(kernels, rows, inter, in_features, with_bias, dtype):
    """Widths of whole 32-element chunks (a model's: SmolLM2's 1536), where eager SiLU is all vector arithmetic:
    bit for bit eager PyTorch's SiLU(gate) * up on gemm_linear's [gate, up] output (itself within the fp64
    bound), with panels of 24 gates and 24 ups (96 and 1536 split evenly, 32 and 64 leave zero rows). Eager
    runs at PyTorch's level in this process: at the others, the same level's unfused silu_mul (which is
    PyTorch's arithmetic at that level) stands in for it."""
    need(kernels, dtype)
    linear = nn.Linear(in_features, 2 * inter, bias=with_bias).to(dtype)
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    x = randn(rows, in_features, seed=2, dtype=dtype)
    gate_up = kernels.gemm_linear(x, kernels.gemm_pack(weight), None if bias is None else bias.float(), 2 * inter)
    within_bound(gate_up, x, weight, bias)
    fused = cpu_linear.fused_gate_up(linear)
    assert isinstance(fused, cpu_linear.FusedGateUp)
    y = fused.silu_mul(x)
    assert y.dtype == dtype and y.shape == (rows, inter)
    assert torch.equal(y, kernels.silu_mul(gate_up))
    if kernels.isa == cpu_native.current_isa():
        assert torch.equal(y, eager_silu_mul(gate_up))
    assert torch.equal(fused(x), gate_up)  # the plain output, put back in [gate, up] order


@pytest.mark.parametrize("inter", [1, 23, 25, 40, 48, 100])
@dtypes
def test_fused_silu_mul_on_any_width_is_the_unfused_kernel(kernels, inter, dtype):
    """Other widths (eager SiLU finishes a row's last < 32 values with a scalar exp, so a model of such a width
    keeps eager SiLU): still the same bits as cpu_fused's silu_mul on the unfused output, and the plain output."""
    need(kernels, dtype)
    linear = nn.Linear(33, 2 * inter).to(dtype)
    x = randn(2, 9, 33, seed=2, dtype=dtype)  # leading dims
    gate_up = kernels.gemm_linear(x, kernels.gemm_pack(linear.weight.detach()), linear.bias.detach().float(),
                                  2 * inter)
    fused = cpu_linear.fused_gate_up(linear)
    y = fused.silu_mul(x)
    assert y.shape == (2, 9, inter)
    assert torch.equal(y.view(18, inter), kernels.silu_mul(gate_up.view(18, 2 * inter)))
    assert torch.equal(fused(x), gate_up)
    assert fused.silu_mul(torch.empty(0, 33, dtype=dtype)).shape == (0, inter)
    assert fused(torch.empty(0, 33, dtype=dtype)).shape == (0, 2 * inter)


def test_fused_silu_mul_refuses_a_mismatched_pack_or_bias(kernels):
    fused = cpu_linear.fused_gate_up(nn.Linear(8, 2 * 30))  # 2 panels: n in (24, 48]
    x = randn(2, 8, seed=2)
    with pytest.raises(RuntimeError, match="gemm_silu_mul: n does not match"):
        kernels.gemm_silu_mul(x, fused.packed.panels, None, 60)
    with pytest.raises(RuntimeError, match="gemm_silu_mul: a float32 bias of 96 values, got Float of 60"):
        kernels.gemm_silu_mul(x, fused.packed.panels, randn(60, seed=3), 30)


def test_decoder_mlp_takes_the_fused_path_unless_a_wrapper_needs_gate_and_up(kernels, monkeypatch):
    """A loaded CPU model's MLPs: gate_up_proj is a FusedGateUp and forward goes through silu_mul (what
    test_real_model's HF equality runs); wrapped (as LoRA wraps it) the MLP calls it plainly and gets the same
    output; with TANDEM_CPU_GEMM=0 nothing is fused."""
    from engine.models.decoder import MLP

    spec = type("Spec", (), {"hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "mlp_bias": False})
    mlp = MLP(spec).eval()
    x = randn(5, 64, seed=2)
    with torch.no_grad():
        expected = mlp(x)
        mlp.gate_up_proj, mlp.kernel = cpu_linear.fused_gate_up(mlp.gate_up_proj), kernels
        calls, silu_mul = [], cpu_linear.FusedGateUp.silu_mul
        monkeypatch.setattr(cpu_linear.FusedGateUp, "silu_mul", lambda self, x: calls.append(x) or silu_mul(self, x))
        fused = mlp(x)
        assert len(calls) == 1
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)  # MKL's and Tandem's sums differ
        wrapped = nn.Sequential(mlp.gate_up_proj)
        mlp.gate_up_proj = wrapped
        assert torch.equal(mlp(x), fused) and len(calls) == 1
    monkeypatch.setenv("TANDEM_CPU_GEMM", "0")
    assert cpu_linear.fused_gate_up(nn.Linear(64, 192)) is None
