"""Tandem's fp32 CPU GEMM (engine/models/cpu_gemm.cpp) against an fp64 reference, and the packed linears
choosing it (engine/models/cpu_linear.py). Whole models through it against Hugging Face are
tests/test_real_model.py, test_correctness_hf.py and test_model_families.py (fp32 greedy token for token).

The bound: any order of fp32 sums of K products is within gamma_K = K u / (1 - K u) (u = 2^-24) of the exact
result, relative to sum |x| |w| (+ |bias|); a dropped term, a wrong column or a missed tail is far outside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_native
from engine.models import cpu_linear

kernels = cpu_native.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.gemm_available(),
                                reason="the CPU extension does not build here, or without AVX-512")


def within_fp32_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    u = 2.0 ** -24
    k = x.shape[-1] + 1  # + 1: the bias add
    gamma = k * u / (1 - k * u)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= gamma * scale + 1e-30).all()), f"max excess {(err - gamma * scale).max().item():.3g}"


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# rows: 1 (decode), the 8-row blocks' tails, 16 and several blocks; columns around the 48-wide panels; K small,
# odd and a model's.
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 70])
@pytest.mark.parametrize("out_features,in_features", [(1, 5), (47, 64), (48, 33), (49, 576), (200, 7), (1000, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_f32_within_the_fp32_bound(rows, out_features, in_features, with_bias):
    w, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    bias = randn(out_features, seed=3) if with_bias else None
    y = kernels.linear_f32(x, kernels.pack_f32(w), bias, out_features)
    within_fp32_bound(y, x, w, bias)


def test_linear_f32_leading_dims_strided_input_and_no_rows():
    w = randn(100, 64, seed=1)
    packed = kernels.pack_f32(w)
    x = randn(2, 5, 64, seed=2)
    y = kernels.linear_f32(x, packed, None, 100)
    assert y.shape == (2, 5, 100)
    within_fp32_bound(y, x, w, None)
    xt = randn(64, 7, seed=4).t()  # not contiguous
    within_fp32_bound(kernels.linear_f32(xt, packed, None, 100), xt, w, None)
    assert kernels.linear_f32(torch.empty(0, 64), packed, None, 100).shape == (0, 100)


def test_pack_pads_the_last_panel_with_zeros():
    w = randn(50, 3, seed=1)
    packed = kernels.pack_f32(w)
    assert packed.shape == (2, 3, 48)
    assert torch.equal(packed[0], w[:48].T) and torch.equal(packed[1, :, :2], w[48:].T)
    assert not packed[1, :, 2:].any()


def test_bad_inputs_are_refused_with_the_reason():
    packed = kernels.pack_f32(randn(10, 8, seed=1))
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        kernels.linear_f32(randn(2, 9, seed=2), packed, None, 10)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.linear_f32(randn(2, 8, seed=2).bfloat16(), packed, None, 10)
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.linear_f32(randn(2, 8, seed=2), packed, None, 60)
    with pytest.raises(RuntimeError, match="bias of 10 floats"):
        kernels.linear_f32(randn(2, 8, seed=2), packed, randn(9, seed=3), 10)
    with pytest.raises(RuntimeError, match="2-D float32"):
        kernels.pack_f32(randn(10, 8, seed=1).double())


def test_packed_linear_picks_tandem_gemm_for_fp32_and_onednn_otherwise(monkeypatch):
    linear = nn.Linear(64, 100)
    x = randn(5, 64, seed=2)
    packed = cpu_linear.PackedLinear(linear)
    assert isinstance(packed.packed, cpu_linear.Panels) and "tandem gemm" in packed.extra_repr()
    within_fp32_bound(packed(x), x, linear.weight.detach(), linear.bias.detach())
    monkeypatch.setenv("TANDEM_CPU_GEMM", "0")
    onednn = cpu_linear.PackedLinear(linear)
    assert not isinstance(onednn.packed, cpu_linear.Panels) and "onednn" in onednn.extra_repr()
    within_fp32_bound(onednn(x), x, linear.weight.detach(), linear.bias.detach())
    monkeypatch.delenv("TANDEM_CPU_GEMM")
    linear16 = nn.Linear(64, 100).bfloat16()
    bf16 = cpu_linear.PackedLinear(linear16)
    assert not isinstance(bf16.packed, cpu_linear.Panels)
    y16 = bf16(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16, F.linear(x.bfloat16(), linear16.weight, linear16.bias), atol=0.05, rtol=0.02)
