"""Tandem's CPU GEMM (engine/models/cpu_gemm.cpp) against an fp64 reference, and the packed linears choosing
it (engine/models/cpu_linear.py). Whole models through it against Hugging Face are tests/test_real_model.py,
test_correctness_hf.py and test_model_families.py (fp32 greedy token for token) and tests/test_moe.py (bf16).

The bound: any order of fp32 sums of K exact products is within gamma_K = K u / (1 - K u) (u = 2^-24) of the
exact result, relative to sum |x| |w| (+ |bias|); bf16 products are exact in fp32, and a bf16 output adds one
rounding (2^-8 relative). A dropped term, a wrong column or a missed tail is far outside it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import cpu_native
from engine.models import cpu_linear

kernels = cpu_native.load()
DTYPES = [getattr(torch, name) for name in getattr(kernels, "gemm_dtypes", ())]
pytestmark = pytest.mark.skipif(not DTYPES, reason="the CPU extension does not build here, or without AVX-512")
dtypes = pytest.mark.parametrize("dtype", [
    pytest.param(dt, marks=pytest.mark.skipif(dt not in DTYPES, reason=f"no {dt} GEMM on this CPU"))
    for dt in (torch.float32, torch.bfloat16)])


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
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 70])
@pytest.mark.parametrize("out_features,in_features", [(1, 5), (47, 64), (48, 33), (49, 576), (200, 7), (1000, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
@dtypes
def test_linear_within_the_summation_bound(rows, out_features, in_features, with_bias, dtype):
    w, x = randn(out_features, in_features, seed=1, dtype=dtype), randn(rows, in_features, seed=2, dtype=dtype)
    bias = randn(out_features, seed=3, dtype=dtype) if with_bias else None
    y = kernels.gemm_linear(x, kernels.gemm_pack(w), None if bias is None else bias.float(), out_features)
    within_bound(y, x, w, bias)


@dtypes
def test_linear_leading_dims_strided_input_and_no_rows(dtype):
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
def test_same_bits_however_the_work_is_split(dtype):
    """12 panels (576 columns, a model's o_proj) on 1-8 threads: by panels alone, or by panels and rows."""
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
def test_pack_layout_and_zero_padding(dtype):
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


def test_bad_inputs_are_refused_with_the_reason():
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
def test_packed_linear_picks_tandem_gemm_and_onednn_without_it(dtype, monkeypatch):
    linear = nn.Linear(64, 100).to(dtype)
    x = randn(5, 64, seed=2, dtype=dtype)
    weight, bias = linear.weight.detach(), linear.bias.detach()
    packed = cpu_linear.PackedLinear(linear)
    assert isinstance(packed.packed, cpu_linear.Panels) and "tandem gemm" in packed.extra_repr()
    within_bound(packed(x), x, weight, bias)
    monkeypatch.setenv("TANDEM_CPU_GEMM", "0")
    onednn = cpu_linear.PackedLinear(linear)
    assert not isinstance(onednn.packed, cpu_linear.Panels) and "onednn" in onednn.extra_repr()
    within_bound(onednn(x), x, weight, bias)
