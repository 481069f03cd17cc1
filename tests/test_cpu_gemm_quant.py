"""Tandem's weight-only quantized linears (engine/cpu/gemm_quant.cpp, engine/cpu/quant.py) against the `gguf`
package: weights quantized by gguf.quants.quantize (or raw blocks made up byte by byte: Q4_K and Q6_K have no
quantizer in gguf-py), the oracle the same bytes dequantized by gguf.quants.dequantize through an fp64 matmul. Every
check runs against each instruction-set level's build this CPU can run (as tests/test_cpu_gemm.py), with both
activations (TANDEM_QUANT_ACTIVATIONS); Q8_0 and Q4_1 through quant.QuantWeight and its torch fallback too, Q5_0,
Q4_K and Q6_K through the kernel's gemm_q_linear alone (their fallback is quant.py's).

fp32 activations: the kernel's weights are gguf's dequantized fp32 weights exactly (every product in them is exact
in fp32, so d * q + m or (d * sc) * q - dmin * m rounds once, as numpy's fp32 arithmetic does, and the others not
at all), so the result is an fp32 dot product of x with them in some order: within gamma_{K+1} = (K + 1) u /
(1 - (K + 1) u) (u = 2^-24) of the exact sum, relative to sum |x| |w| (+ |bias|), + 1 for the bias add.

int8 activations: x is quantized as gguf's own Q8_0 quantizer does it (checked byte for byte), so the oracle is
gguf's round trip of x, x^ = d_x q_x, times gguf's dequantized weights in fp64. The kernel's integer dots are
exact (the K-quants' integer sub-block scales multiply them, exact too), and d_w d_x (d_w: a K-quant's fp16
super-block d, so no rounding more than for the other types), Q4_1's d_x sum(q_x) and Q4_K's dmin m_j are exact in
fp32; per output it sums at most T = 8 B + B + 1 terms (B = K / 32 blocks: 8 int32 lanes a block each scaled by
d_w d_x, Q4_1's and Q4_K's B min terms, the bias), each rounded once, in some order: within gamma_T of their exact
sum relative to the sum of their magnitudes, which is at most sum |x^| mag(w) (+ |bias|): mag = |w| for Q8_0 and
Q6_K (signed quants), |d q| + |m| for Q4_1, |d sc q| + |dmin m| for Q4_K, and |d| (q + 16) for Q5_0 (AVX-512 starts
a block's first lanes from -16 sum(q_x)). That exact sum is sum x^ (d q + m) (and so on), whereas gguf's weight
is that rounded to fp32 once (Q4_1, Q4_K; exact for the others), u relative: so within gamma_{9 B + 2} of the
oracle. The packed layout's kernels (Q8_0 and Q4_1 where the build has AVX-512 VNNI: quant.pack_rows) sum a block's
32 products in one integer lane, so an output has T = B + B + 2 terms, fewer: the same bound holds. The torch
fallback is F.linear of the same x^ and weights: the fp32 bound above with x^ for x.

A wrong nibble, bit, swapped scale, dropped block or sign is far outside either bound; where every product and
partial sum is exact in fp32 (power-of-two scales, small integers; for int8, x with a 127 in every block, so
d_x = 1, and halves, which gguf rounds away from zero), the result is exact."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.attention import cpu_native
from engine.cpu import quant

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="the CPU extension does not build here")
QT = {name: gguf.GGMLQuantizationType[name] for name in ("Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")}
QK = {"Q8_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}  # weights a block (super-block)
qtypes = pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])  # the types quant.QuantWeight takes here
new_qtypes = pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K"])  # the kernel's alone
kernel_levels = pytest.mark.parametrize("level", cpu_native.isas(), indirect=True)  # no torch fallback


@pytest.fixture(scope="module", params=[*cpu_native.isas(), "torch"])
def level(request):
    """A level's build (the test id names it; where this CPU's own level builds, every level must), or "torch":
    the fallback that dequantizes with torch ops."""
    if request.param == "torch":
        return None
    module = cpu_native.load(request.param)
    assert module is not None and module.isa == request.param and module.gemm_q_types == tuple(QT)
    return module


@pytest.fixture(autouse=True)
def linears_use_the_level(level, monkeypatch):
    monkeypatch.setattr(cpu_native, "load", lambda isa=None: level)
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")  # a test of int8 asks for `activations`
    if level is None:
        monkeypatch.setenv("TANDEM_CPU_GEMM", "0")


@pytest.fixture(params=quant.ACTIVATIONS)
def activations(request, monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", request.param)
    return request.param


def quantized(qtype: str, n: int, k: int, seed: int) -> tuple[quant.QuantWeight, np.ndarray]:
    """Random weights (rows of very different scales, some all positive so Q4_1's min is not just -max)
    quantized by gguf; returns them and gguf's dequantization of the same bytes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.choice([1e-3, 0.05, 1.0, 30.0], size=(n, 1))
    w[::3] = np.abs(w[::3]) + 0.5
    data = gguf.quants.quantize(w, QT[qtype])
    return quant.QuantWeight(qtype, torch.from_numpy(data), k), gguf.quants.dequantize(data, QT[qtype])


def within_bound(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), torch.from_numpy(w).double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    u, k = 2.0 ** -24, x.shape[-1] + 1
    bound = k * u / (1 - k * u) * scale
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3g}"


def gguf_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as gguf quantizes it to Q8_0 and dequantizes it back (fp32)."""
    T = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), T), T)).view(x.shape)


def magnitudes(qtype: str, data: np.ndarray) -> np.ndarray:
    """mag(w) of every weight (the module's docstring): gguf's dequantization of the blocks with d's sign bit
    cleared (and Q4_1's m's, and Q4_K's dmin's set: -dmin m is then |dmin| m), plus 32 |d| for Q5_0."""
    if qtype in ("Q8_0", "Q6_K"):
        return np.abs(gguf.quants.dequantize(data, QT[qtype]))
    bytes_ = {"Q4_1": 20, "Q5_0": 22, "Q4_K": 144}[qtype]
    blocks = data.reshape(data.shape[0], -1, bytes_).copy()
    blocks[..., 1] &= 0x7F  # fp16 d's high byte
    if qtype == "Q4_1":
        blocks[..., 3] &= 0x7F
    if qtype == "Q4_K":
        blocks[..., 3] |= 0x80
    mag = gguf.quants.dequantize(blocks.reshape(data.shape[0], -1), QT[qtype])  # Q5_0: |d| (q - 16)
    if qtype == "Q5_0":
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [n, K / 32, 1]
        mag = mag + np.repeat(32 * d[..., 0], 32, axis=1)
    return mag


def within_int8_bound(y: torch.Tensor, x: torch.Tensor, qtype: str, data: np.ndarray, w: np.ndarray,
                      bias: torch.Tensor | None, level) -> None:
    xq = gguf_q8_0(x.contiguous())
    if level is None:  # the fallback: F.linear of gguf's x^ and w
        return within_bound(y, xq, w, bias)
    x64, w64 = xq.double(), torch.from_numpy(w).double()
    b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if bias is None else bias.double()
    exact = x64 @ w64.T + b64
    scale = x64.abs() @ torch.from_numpy(magnitudes(qtype, data)).double().T + b64.abs()
    u, n = 2.0 ** -24, 9 * x.shape[-1] // 32 + 2
    bound = n * u / (1 - n * u) * scale
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound + 1e-30).all()), f"max excess {(err - bound).max().item():.3g}"


def expect(y, x, weight, w, bias, activations, level) -> None:
    if activations == "fp32":
        within_bound(y, x, w, bias)
    else:
        within_int8_bound(y, x, weight.qtype, weight.data.numpy(), w, bias, level)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# rows: decode's 1, the tiles' tails (4 rows a tile under AVX-512, 2 under AVX2), 64-row chunks and past them;
# outputs around the 4-row weight tiles; K of one block, a few, a model's.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64, 70, 131])
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (5, 64), (47, 96), (200, 576), (66, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
@qtypes
def test_linear_within_the_summation_bound_of_ggufs_dequantized_weights(rows, out_features, in_features,
                                                                        with_bias, qtype, activations, level):
    weight, oracle = quantized(qtype, out_features, in_features, seed=rows)
    x = randn(rows, in_features, seed=2) * torch.tensor([1e-3, 1.0, 40.0]).repeat(rows)[:rows, None]
    bias = randn(out_features, seed=3) if with_bias else None
    expect(weight(x, bias), x, weight, oracle, bias, activations, level)


def raw_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks made byte by byte: power-of-two scales (and small-integer mins), every quant value possible."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 32
    d = rng.choice(np.float16([0.25, 0.5, 1.0, 2.0, -1.0]), size=(blocks, 1)).view(np.uint8)
    if qtype == "Q8_0":
        qs = rng.integers(-128, 128, size=(blocks, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate((d, qs), axis=1).reshape(n, -1)
    m = rng.integers(-8, 9, size=(blocks, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, size=(blocks, 16)).astype(np.uint8)
    return np.concatenate((d, m, qs), axis=1).reshape(n, -1)


@qtypes
def test_linear_exact_where_the_sums_are(qtype):
    """Power-of-two scales, integer quants and x: every product and partial sum is an exact fp32 value, so any
    order gives the exact result, and every byte, nibble and scale of the layout must be read as gguf reads it."""
    for rows, n, k in [(1, 9, 32), (5, 50, 96), (70, 13, 576)]:
        data = raw_blocks(qtype, n, k, seed=n)
        oracle = torch.from_numpy(gguf.quants.dequantize(data, QT[qtype]))
        x = torch.randint(-8, 9, (rows, k), generator=torch.Generator().manual_seed(k)).float()
        bias = torch.arange(n, dtype=torch.float32) * 0.5
        y = quant.QuantWeight(qtype, torch.from_numpy(data), k)(x, bias)
        assert torch.equal(y, (x.double() @ oracle.double().T + bias.double()).float())


@qtypes
def test_int8_exact_where_the_sums_are(qtype, monkeypatch):
    """The int8 path where x quantizes exactly (a 127 in every block: d_x = 1) and every product and sum is an
    exact fp32 value; x's halves are ties, which gguf's quantizer rounds away from zero, and so must the kernel."""
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "int8")
    for rows, n, k in [(1, 9, 32), (5, 50, 96), (70, 13, 576)]:
        data = raw_blocks(qtype, n, k, seed=n)
        oracle = torch.from_numpy(gguf.quants.dequantize(data, QT[qtype]))
        gen = torch.Generator().manual_seed(k)
        x = torch.randint(-32, 33, (rows, k), generator=gen).float() / 2
        x[:, ::32] = 127 * (torch.randint(0, 2, (rows, k // 32), generator=gen).float() * 2 - 1)
        assert bool((x.frac() != 0).any())
        xq = gguf_q8_0(x)
        assert torch.equal(xq, x.round()) is False and torch.equal(xq, torch.sign(x) * (x.abs() + 0.5).floor())
        bias = torch.arange(n, dtype=torch.float32) * 0.5
        y = quant.QuantWeight(qtype, torch.from_numpy(data), k)(x, bias)
        assert torch.equal(y, (xq.double() @ oracle.double().T + bias.double()).float())


def q8_0_cases() -> np.ndarray:
    """Rows of x to quantize: scales from fp16's subnormals to past its range's middle, a block of zeros, ties
    (halves with d = 1), and values just either side of them."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 96)).astype(np.float32) * rng.choice([1e-7, 1e-4, 1.0, 50.0, 3e3], size=(40, 1))
    x[0, :32] = 0
    x[1] = np.tile(np.arange(-15.5, 16.5, 1.0), 3)
    x[1, ::32] = 127
    x[2] = np.nextafter(x[1], np.float32(np.inf))
    x[3] = np.nextafter(x[1], np.float32(-np.inf))
    x[4] = -x[1]
    return x.astype(np.float32)


def test_x_is_quantized_as_ggufs_q8_0(level):
    """The int8 path's activations, byte for byte gguf.quants.quantize(x, Q8_0) (the kernel's own quantizer), or
    value for value gguf's round trip (the fallback's torch ops)."""
    x = q8_0_cases()
    want = gguf.quants.quantize(x, QT["Q8_0"])
    if level is None:
        assert torch.equal(quant.q8_0_round_trip(torch.from_numpy(x)), gguf_q8_0(torch.from_numpy(x)))
    else:
        got = level.quantize_q8_0(torch.from_numpy(x))
        assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)


@qtypes
def test_dequantize_is_ggufs_bit_for_bit(qtype):
    """The torch fallback's (and the embedding's) dequantization, whole and by rows."""
    data = raw_blocks(qtype, 40, 96, seed=1)
    weight = quant.QuantWeight(qtype, torch.from_numpy(data), 96)
    oracle = torch.from_numpy(gguf.quants.dequantize(data, QT[qtype]))
    assert torch.equal(weight.dequantize(), oracle)
    rows = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(weight.dequantize(rows), oracle[rows.reshape(-1)])
    embedding = quant.QuantEmbedding(weight)
    assert torch.equal(embedding(rows), oracle[rows])


@qtypes
def test_same_bits_whatever_the_batch_and_threads(level, qtype, activations):
    """A row's output does not depend on the rows beside it (decode's one row against a 70-row prefill chunk) or on
    how many threads split the work."""
    weight, oracle = quantized(qtype, 576, 576, seed=1)
    x = randn(70, 576, seed=2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            outs.append(weight(x))
    finally:
        torch.set_num_threads(threads)
    expect(outs[0], x, weight, oracle, None, activations, level)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    if level is not None:  # the torch fallback goes through MKL, whose blocking may depend on the row count
        assert torch.equal(weight(x[37:38]), outs[0][37:38]) and torch.equal(weight(x[:5]), outs[0][:5])


def test_leading_dims_strided_input_and_no_rows(activations, level):
    weight, oracle = quantized("Q4_1", 30, 64, seed=1)
    x = randn(2, 5, 64, seed=2)
    y = weight(x)
    assert y.shape == (2, 5, 30)
    expect(y.view(10, 30), x.view(10, 64), weight, oracle, None, activations, level)
    xt = randn(64, 7, seed=4).t()
    expect(weight(xt), xt, weight, oracle, None, activations, level)
    assert weight(torch.empty(0, 64)).shape == (0, 30)


def test_quant_linear_stacks_parts_of_different_types():
    """q/k/v (or gate/up) of one type become one weight; a type change starts another part, output in order."""
    a, oa = quantized("Q8_0", 20, 64, seed=1)
    b, ob = quantized("Q8_0", 12, 64, seed=2)
    c, oc = quantized("Q4_1", 9, 64, seed=3)
    bias = randn(41, seed=4)
    linear = quant.QuantLinear([a, b, c], bias)
    assert [(p.qtype, p.out_features) for p in linear.parts] == [("Q8_0", 32), ("Q4_1", 9)]
    assert linear.out_features == 41 and "Q8_0+Q4_1" in linear.extra_repr()
    x = randn(3, 64, seed=5)
    within_bound(linear(x), x, np.concatenate((oa, ob, oc)), bias)


def test_bad_inputs_are_refused_with_the_reason(level, monkeypatch):
    with pytest.raises(ValueError, match="'Q5_K' is not supported; valid: Q8_0, Q4_1, Q5_0, Q4_K, Q6_K"):
        quant.QuantWeight("Q5_K", torch.zeros(2, 176, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        quant.QuantWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match=r"uint8 \[N, 68\]; got torch.uint8 \(2, 34\)"):
        quant.QuantWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="bias of shape"):
        quant.QuantLinear([quantized("Q8_0", 4, 32, seed=1)[0]], torch.zeros(5))
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="TANDEM_QUANT_ACTIVATIONS='int4' is not valid; valid: int8, fp32"):
        quant.QuantLinear([quantized("Q8_0", 4, 32, seed=1)[0]])
    if level is None:
        return
    weight = quantized("Q4_1", 4, 64, seed=1)[0]
    with pytest.raises(RuntimeError, match="x has 96 features; the weight's rows hold 40 bytes, 64 features"):
        level.gemm_q_linear(randn(2, 96, seed=2), weight.data, 3, None, True)
    with pytest.raises(RuntimeError, match="x must be float32, got BFloat16"):
        level.gemm_q_linear(randn(2, 64, seed=2).bfloat16(), weight.data, 3, None, True)
    with pytest.raises(RuntimeError, match=r"ggml type 2 is not supported; valid: 8 \(Q8_0\), 3 \(Q4_1\), 6 \(Q5_0\), "
                                           r"12 \(Q4_K\), 14 \(Q6_K\)"):
        level.gemm_q_linear(randn(2, 64, seed=2), weight.data, 2, None, False)
    with pytest.raises(RuntimeError, match="float32 bias of 4 values, got Float of 3"):
        level.gemm_q_linear(randn(2, 64, seed=2), weight.data, 3, randn(3, seed=3), True)


# Q5_0, Q4_K and Q6_K: the kernel's gemm_q_linear at each level (quant.QuantWeight's torch fallback is quant.py's).

def new_blocks(qtype: str, n: int, k: int, seed: int, exact: bool = False) -> np.ndarray:
    """uint8 [n, k / QK * block bytes]. Q5_0 quantized by gguf (rows of very different scales), unless `exact`;
    otherwise made up byte by byte: random quants, bits, scales and mins (every value possible), fp16 scales near
    2^-8 times a row's factor (some subnormal), either sign, or with `exact` +-2^-4 (Q4_K's dmin 2^-4 or 2^-5)."""
    rng = np.random.default_rng(seed)
    if qtype == "Q5_0" and not exact:
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.choice([1e-3, 0.05, 1.0, 30.0], size=(n, 1))
        return gguf.quants.quantize(w, QT[qtype])
    blocks = n * k // QK[qtype]
    row = np.repeat(rng.choice([1e-2, 1.0, 64.0], size=n), blocks // n)[:, None]

    def scale(powers=(2.0 ** -4,)) -> np.ndarray:  # [blocks, 2] uint8: an fp16 a block
        d = rng.choice(powers, size=(blocks, 1)) if exact else rng.uniform(0.5, 2.0, (blocks, 1)) * 2.0 ** -8 * row
        return (d * rng.choice([-1.0, 1.0], size=(blocks, 1))).astype(np.float16).view(np.uint8)

    def rand(count: int) -> np.ndarray:
        return rng.integers(0, 256, size=(blocks, count), dtype=np.uint8)

    parts = {"Q5_0": lambda: (scale(), rand(20)),  # d, qh, qs
             "Q4_K": lambda: (scale(), scale((2.0 ** -4, 2.0 ** -5)), rand(140)),  # d, dmin, scales, qs
             "Q6_K": lambda: (rand(208), scale())}[qtype]()  # ql, qh, scales, d
    return np.concatenate(parts, axis=1).reshape(n, -1)


def gemm(level, qtype: str, data: np.ndarray, x: torch.Tensor, bias=None, int8: bool = False) -> torch.Tensor:
    return level.gemm_q_linear(x, torch.from_numpy(data), int(QT[qtype]), bias, int8)


def expect_new(y, x, qtype, data, bias, activations, level) -> None:
    w = gguf.quants.dequantize(data, QT[qtype])
    if activations == "fp32":
        within_bound(y, x, w, bias)
    else:
        within_int8_bound(y, x, qtype, data, w, bias, level)


# rows: decode's 1, a tile's tail, a few tiles, past a 64-row chunk; K of one block, three (an odd count: the
# AVX-512 tiles' pairs), eight; outputs around the tiles' 2 and 4 weight rows.
@kernel_levels
@new_qtypes
@pytest.mark.parametrize("rows", [1, 3, 17, 70])
@pytest.mark.parametrize("out_features,blocks", [(1, 1), (7, 3), (33, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_new_types_within_the_summation_bound_of_ggufs_dequantized_weights(level, qtype, rows, out_features,
                                                                           blocks, with_bias, activations):
    k = blocks * QK[qtype]
    data = new_blocks(qtype, out_features, k, seed=rows + blocks)
    x = randn(rows, k, seed=2) * torch.tensor([1e-3, 1.0, 40.0]).repeat(rows)[:rows, None]
    bias = randn(out_features, seed=3) if with_bias else None
    y = gemm(level, qtype, data, x, bias, activations == "int8")
    expect_new(y, x, qtype, data, bias, activations, level)


@kernel_levels
@new_qtypes
def test_new_types_exact_where_the_sums_are(level, qtype, activations):
    """Power-of-two scales, integer quants and x (int8: x with a 127 in every block, so d_x = 1, and halves, which
    gguf rounds away from zero): every product and partial sum is a multiple of 2^-5 below 2^19, an exact fp32
    value, so any order gives the exact result, and every byte, bit, scale and min of the layout must be read as
    gguf reads it."""
    for rows, n, blocks in [(1, 9, 1), (5, 13, 3), (70, 7, 2)]:
        k = blocks * QK[qtype]
        data = new_blocks(qtype, n, k, seed=n, exact=True)
        oracle = torch.from_numpy(gguf.quants.dequantize(data, QT[qtype])).double()
        gen = torch.Generator().manual_seed(k)
        if activations == "fp32":
            x = torch.randint(-8, 9, (rows, k), generator=gen).float()
            xq = x
        else:
            x = torch.randint(-8, 9, (rows, k), generator=gen).float() / 2
            x[:, ::32] = 127 * (torch.randint(0, 2, (rows, k // 32), generator=gen).float() * 2 - 1)
            xq = gguf_q8_0(x)
            assert torch.equal(xq, torch.sign(x) * (x.abs() + 0.5).floor())
        bias = torch.arange(n, dtype=torch.float32) * 0.5
        scale = xq.double().abs() @ torch.from_numpy(magnitudes(qtype, data)).double().T + bias.double()
        assert scale.max() < 2.0 ** 19
        y = gemm(level, qtype, data, x, bias, activations == "int8")
        assert torch.equal(y, (xq.double() @ oracle.T + bias.double()).float())


@kernel_levels
@new_qtypes
def test_new_types_same_bits_whatever_the_batch_and_threads(level, qtype, activations):
    """As for Q8_0 and Q4_1: a row's output does not depend on the rows beside it or on the threads."""
    k = 640 if qtype == "Q5_0" else 1024  # Gemma 3 270M's
    data = new_blocks(qtype, 66, k, seed=1)
    x = randn(70, k, seed=2)
    threads, int8 = torch.get_num_threads(), activations == "int8"
    try:
        outs = []
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            outs.append(gemm(level, qtype, data, x, None, int8))
    finally:
        torch.set_num_threads(threads)
    expect_new(outs[0], x, qtype, data, None, activations, level)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert torch.equal(gemm(level, qtype, data, x[37:38], None, int8), outs[0][37:38])
    assert torch.equal(gemm(level, qtype, data, x[:5], None, int8), outs[0][:5])


@kernel_levels
@new_qtypes
def test_new_types_refuse_k_not_a_multiple_of_their_block(level, qtype):
    qk, data = QK[qtype], torch.from_numpy(new_blocks(qtype, 4, 2 * QK[qtype], seed=1))
    bytes_ = data.shape[1] // 2
    for int8 in (True, False):
        with pytest.raises(RuntimeError, match=f"x has {qk + 16} features; {qtype} weights take a multiple of {qk}"):
            level.gemm_q_linear(randn(2, qk + 16, seed=2), data, int(QT[qtype]), None, int8)
    with pytest.raises(RuntimeError, match=f"x has {3 * qk} features; the weight's rows hold {2 * bytes_} bytes, "
                                           f"{2 * qk} features of {bytes_}-byte blocks of {qk}"):
        level.gemm_q_linear(randn(2, 3 * qk, seed=2), data, int(QT[qtype]), None, True)


# The packed layout (quant.pack_rows; gemm_q_packed_types: Q8_0 and Q4_1 in builds with AVX-512 VNNI): where a level
# packs, QuantWeight runs it and every test above checks it through QuantWeight; the tiles over the file's layout
# (what that level runs for the other types, and on a CPU without VNNI) are checked here directly.

def packed_by_definition(qtype: str, data: np.ndarray) -> np.ndarray:
    """The packed layout written out from its definition, a byte at a time: per group of 16 rows (zero rows after
    the last) and block j: dword k of each row's quants in row order (Q8_0's + 128), then the rows' d, then Q4_1's m."""
    nbytes, head = {"Q8_0": (34, 2), "Q4_1": (20, 4)}[qtype]
    n, blocks = data.shape[0], data.shape[1] // nbytes
    groups = -(-n // 16)
    rows = np.zeros((groups * 16, data.shape[1]), np.uint8)
    rows[:n] = data
    out = []
    for g in range(groups):
        for j in range(blocks):
            unit = []
            block = [rows[16 * g + lane, j * nbytes:(j + 1) * nbytes] for lane in range(16)]
            for k in range((nbytes - head) // 4):
                for b in block:
                    dword = b[head + 4 * k:head + 4 * k + 4]
                    unit.extend(int(v) ^ 0x80 if qtype == "Q8_0" else int(v) for v in dword)
            for s in range(0, head, 2):
                for b in block:
                    unit.extend(int(v) for v in b[s:s + 2])
            out.extend(unit)
    return np.array(out, np.uint8).reshape(groups, -1)


@qtypes
@pytest.mark.parametrize("n", [1, 16, 21, 40])
def test_packed_layout_is_its_definition(qtype, n):
    data = raw_blocks(qtype, n, 96, seed=n)
    assert np.array_equal(quant.pack_rows(qtype, torch.from_numpy(data)).numpy(), packed_by_definition(qtype, data))


@kernel_levels
@qtypes
@pytest.mark.parametrize("n", [1, 21, 40])
def test_packed_rows_are_the_files_rows(level, qtype, n):
    """The kernel's rows of a packed weight in the file's layout (any build: byte moves), every row in order (a
    packed QuantWeight's `data`) and a lookup's rows in any order, repeats included (an embedding's)."""
    data = torch.from_numpy(raw_blocks(qtype, n, 96, seed=2))
    packed = quant.pack_rows(qtype, data)
    assert torch.equal(level.packed_rows(packed, int(QT[qtype]), torch.arange(n)), data)
    rows = torch.tensor([n - 1, 0, n // 2, n // 2])
    assert torch.equal(level.packed_rows(packed, int(QT[qtype]), rows), data[rows])
    limit = -(-n // 16) * 16  # the padding rows are the packed tensor's too
    with pytest.raises(RuntimeError, match=f"row {limit} is out of range"):
        level.packed_rows(packed, int(QT[qtype]), torch.tensor([limit]))


@qtypes
def test_weights_pack_where_the_level_has_packed_kernels(level, qtype):
    """A packed weight holds its file's bytes plus its padding rows, reads back as them, and says so."""
    data = raw_blocks(qtype, 21, 96, seed=1)
    weight = quant.QuantWeight(qtype, torch.from_numpy(data), 96)
    packs = level is not None and qtype in level.gemm_q_packed_types
    assert weight.packed is packs and ("packed" in repr(weight)) is packs
    assert weight.nbytes == (32 if packs else 21) * data.shape[1]  # 2 groups of 16 rows
    assert torch.equal(weight.data, torch.from_numpy(data)) and weight.out_features == 21


@kernel_levels
@qtypes
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("out_features,in_features", [(5, 64), (47, 96), (66, 1536)])
def test_file_layout_tiles_within_the_bound_at_every_level(level, qtype, rows, out_features, in_features,
                                                           activations):
    weight, oracle = quantized(qtype, out_features, in_features, seed=rows)
    x = randn(rows, in_features, seed=2) * torch.tensor([1e-3, 1.0, 40.0]).repeat(rows)[:rows, None]
    bias = randn(out_features, seed=3)
    y = level.gemm_q_linear(x, weight.data, int(QT[qtype]), bias, activations == "int8")
    expect(y, x, weight, oracle, bias, activations, level)


@kernel_levels
def test_packed_kernel_refuses_what_it_cannot_run(level):
    data = torch.from_numpy(raw_blocks("Q4_1", 20, 64, seed=1))
    if "Q4_1" not in level.gemm_q_packed_types:
        assert level.gemm_q_packed_types == ()
        with pytest.raises(RuntimeError, match="no packed kernel for Q4_1 in this build"):
            level.gemm_q_packed(randn(1, 64, seed=2), data, 3, None, 20, True)
        return
    assert level.gemm_q_packed_types == ("Q8_0", "Q4_1")
    packed = quant.pack_rows("Q4_1", data)
    with pytest.raises(RuntimeError, match="no packed kernel for Q5_0 in this build"):
        level.gemm_q_packed(randn(1, 64, seed=2), packed, 6, None, 20, True)
    with pytest.raises(RuntimeError, match=r"20 outputs of 64 features packed are a contiguous uint8 \[2, 640\]; "
                                           r"got Byte \[2, 960\]"):
        level.gemm_q_packed(randn(1, 96, seed=2)[:, :64], quant.pack_rows("Q4_1", torch.cat([data, data[:, :20]], 1)),
                            3, None, 20, True)
    with pytest.raises(RuntimeError, match="x must be float32, got BFloat16"):
        level.gemm_q_packed(randn(1, 64, seed=2).bfloat16(), packed, 3, None, 20, False)
    with pytest.raises(RuntimeError, match="float32 bias of 20 values, got Float of 3"):
        level.gemm_q_packed(randn(1, 64, seed=2), packed, 3, randn(3, seed=3), 20, True)
