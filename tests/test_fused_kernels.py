"""The fused forward's Triton kernels (engine/models/fused_kernels.py) against the eager PyTorch path they
replace (engine/models/decoder.py's RMSNorm, apply_rope, store_kv, MLP), on CPU tensors under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) and compiled on CUDA (marked gpu).

Tolerances are derived, not tuned. The kernels make the eager path's roundings in the eager order; what differs
is the order of a row's fp32 sum of squares (and on CUDA, fused multiply-adds). So:
- fp32: an n-term fp32 sum in another order differs by at most about n * 2^-24 of the sum of its terms'
  magnitudes; a norm's output then differs by that relative amount plus a few ulps of the rsqrt (`fp32_tol`).
- bf16: the fp32 value before each rounding differs by far less than a bf16 ulp, so each rounding step after
  the first difference can land one ulp apart; the bound is (rounding steps) ulps of the output (`ulps`).
- gate_up_act keeps gate and up in fp32 where eager rounds them to the dtype: it is held to the exact (float64)
  value within the fp32 dot products' summation error plus one final rounding, and eager is held to its own
  larger bound, so the test shows the fused result is the more accurate one rather than just "close".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import triton_paged
from engine.attention.torch_paged import store_kv
from engine.models import fused_kernels as fk
from engine.models.decoder import RMSNorm, apply_rope

interpreted = pytest.mark.skipif(not triton_paged.INTERPRETED,
                                 reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set without CUDA)")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
U32 = 2.0 ** -24  # fp32 unit roundoff

pytestmark = pytest.mark.skipif(not triton_paged.AVAILABLE, reason="triton is not installed")


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at |x| (float64): 2^(exponent - mantissa bits); subnormals floored."""
    bits = {torch.bfloat16: 7, torch.float32: 23}[dtype]
    tiny = torch.finfo(dtype).tiny
    e = torch.floor(torch.log2(x.double().abs().clamp_min(tiny)))
    return torch.exp2(e - bits)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (out.double().cpu() - ref.double().cpu()).abs()
    bad = err > bound.cpu()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst error "
                           f"{(err - bound.cpu()).max().item():.3e} past its bound")


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def norm_module(n: int, eps: float, unit_offset: bool, dtype, device, seed: int) -> RMSNorm:
    norm = RMSNorm(n, eps, unit_offset)
    norm.weight.data = rand(n, seed=seed, scale=0.5, dtype=dtype, device=device) + (0 if unit_offset else 1)
    return norm.to(device)


def fp32_tol(ref: torch.Tensor, n: int) -> torch.Tensor:
    """A norm output's bound in fp32: the sum of n squares reordered (n * u relative, halved by the square
    root) plus 8 ulps for the rsqrt/division and the products after it."""
    return ref.double().abs() * (n * U32 + 8 * 2 * U32)


# ---- residual add + RMSNorm -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["first", "pre_norm", "sandwich", "gemma_first"])
@pytest.mark.parametrize("n", [64, 96])
def test_add_rms_norm_matches_eager(form, n, dtype, device):
    """first: norm(x) (layer 0's input norm); pre_norm: Llama's norm(x + residual); sandwich: Gemma's
    norm_b(residual + norm_a(x)) with (1 + w) weights; gemma_first: a (1 + w) norm alone. n = 96 is not a
    power of two (masked tail)."""
    t, eps = 7, 1e-6
    gemma = form in ("sandwich", "gemma_first")
    x = rand(t, n, seed=1, scale=3.0, dtype=dtype, device=device)
    res = rand(t, n, seed=2, scale=5.0, dtype=dtype, device=device)
    norm = norm_module(n, eps, gemma, dtype, device, seed=3)
    pre = norm_module(n, eps, gemma, dtype, device, seed=4)
    with torch.no_grad():
        if form == "pre_norm":
            stream = x + res
            out, got_stream = fk.add_rms_norm(x, res, norm.weight, eps)
        elif form == "sandwich":
            normed = pre(x)
            stream = res + normed
            out, got_stream = fk.add_rms_norm(x, res, norm.weight, eps, unit_offset=True, pre_weight=pre.weight)
        else:
            stream = x
            out, got_stream = fk.add_rms_norm(x, None, norm.weight, eps, unit_offset=gemma)
        ref = norm(stream)
    assert out.dtype == dtype and got_stream.dtype == dtype
    if form == "sandwich":
        # The stream is res + norm_a(x): norm_a's error (bounded on its output, whose size can be far above
        # the sum's where res cancels it) plus the add's one rounding. The second norm scales that error by
        # its factor (1 + w) * rstd.
        if dtype == torch.float32:
            stream_bound = fp32_tol(normed, n) + U32 * stream.double().abs()
        else:
            stream_bound = ulp(normed, dtype) + ulp(stream, dtype)
        assert_within(got_stream, stream, stream_bound, "sandwich stream")
        s64 = stream.double()
        factor = (1 + norm.weight.double()) * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
        carried = factor.abs() * stream_bound
    else:
        assert torch.equal(got_stream, stream)  # the same single rounding of the same sum
        carried = 0
    # Llama's norm rounds twice in bf16 (x * rstd, then the weight product), Gemma's once.
    own = fp32_tol(ref, n) if dtype == torch.float32 else (1 if gemma else 2) * ulp(ref, dtype)
    assert_within(out, ref, own + carried, f"{form} norm")


def test_add_rms_norm_rejects_a_pre_norm_without_residual():
    with pytest.raises(ValueError, match="pre-norm needs a residual"):
        w = torch.ones(8)
        fk.add_rms_norm(torch.ones(2, 8), None, w, 1e-6, pre_weight=w)


# ---- RoPE (+ q/k norm) + KV-cache write ------------------------------------------------------------------------

ROPE_CASES = {  # heads, kv heads, head_dim, rotary dims, q/k norm (None, "qwen3" or "gemma"), block size
    "llama_gqa2": (4, 2, 32, 32, None, 4),
    "mqa": (4, 1, 16, 16, None, 8),
    "phi_partial_rotary": (4, 2, 32, 16, None, 4),
    "qwen3_qk_norm": (4, 2, 32, 32, "qwen3", 4),
    "gemma3_qk_norm_unit_offset": (4, 2, 16, 16, "gemma", 3),
}


def rope_case(name: str, dtype, device):
    h, hkv, d, rot, qk, bs = ROPE_CASES[name]
    t, positions_max, num_blocks = 6, 40, 12
    qkv = rand(t, (h + 2 * hkv) * d, seed=5, scale=2.0, dtype=dtype, device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.arange(positions_max, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.tensor([0, 3, 39, 17, 17, 8], device=device)
    slots = torch.tensor([5, -1, 0, 12, 30, 21], device=device)  # -1: a padding row, nothing stored
    norms = None
    if qk is not None:
        norms = tuple(norm_module(d, 1e-6, qk == "gemma", dtype, device, seed=s) for s in (6, 7))
    caches = [rand(num_blocks, bs, hkv, d, seed=s, dtype=dtype, device=device) for s in (8, 9)]
    return (h, hkv, d), qkv, positions, cos, sin, slots, norms, caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_store_matches_eager(name, dtype, device):
    (h, hkv, d), qkv, positions, cos, sin, slots, norms, caches = rope_case(name, dtype, device)
    t = qkv.shape[0]
    ref_k, ref_v = (c.clone() for c in caches)
    with torch.no_grad():  # the eager path of Attention.attend, then the backends' store_kv
        tables = (cos.index_select(0, positions).to(dtype)[:, None], sin.index_select(0, positions).to(dtype)[:, None])
        qk = qkv[:, : (h + hkv) * d].view(t, -1, d)
        q, k = qk[:, :h], qk[:, h:]
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        ref_q, k = apply_rope(q, *tables), apply_rope(k, *tables)
        live = slots >= 0  # the reference store has no padding rows
        store_kv(k[live], qkv[:, (h + hkv) * d:].view(t, hkv, d)[live], ref_k, ref_v, slots[live])
        kc, vc = (c.clone() for c in caches)
        out_q = fk.rope_store(qkv, positions, cos, sin, h, hkv, d, kc, vc, slots,
                              *((norms[0].weight, norms[1].weight, 1e-6, norms[0].unit_offset) if norms else ()))
    assert torch.equal(vc, ref_v)  # a copy
    if norms is None and (device == "cpu" or dtype != torch.float32):
        # Same products rounded the same way: exact (fp32 on CUDA may contract a product into an FMA).
        assert torch.equal(out_q, ref_q) and torch.equal(kc, ref_k)
        return
    # Bounds scale with each head row's largest value (a rotation keeps the row's size): fp32, a reordered
    # head_dim-term sum of squares plus a few ulps (and an FMA on CUDA); bf16, the normed inputs may sit an ulp
    # apart after each of their (one or two) roundings, then the products and the sum round again: 4 ulps.
    def bound(ref: torch.Tensor) -> torch.Tensor:
        row = ref.double().abs().amax(-1, keepdim=True).expand_as(ref)
        return row * ((d + 16) * U32) if dtype == torch.float32 else 4 * ulp(row, dtype)

    assert_within(out_q, ref_q, bound(ref_q), "q")
    written = slots >= 0
    blk, off = slots[written] // kc.shape[1], slots[written] % kc.shape[1]
    assert_within(kc[blk, off], ref_k[blk, off], bound(ref_k[blk, off]), "k in the cache")
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool)
    untouched[blk.cpu(), off.cpu()] = False
    assert torch.equal(kc[untouched.to(kc.device)], caches[0][untouched.to(kc.device)])


def test_rope_store_rejects_mismatched_shapes():
    qkv = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="is not \\[T, \\(H \\+ 2 Hkv\\) \\* D\\]"):
        fk.rope_store(qkv, torch.zeros(2, dtype=torch.long), torch.zeros(4, 8), torch.zeros(4, 8), 4, 2, 16,
                      torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16), torch.zeros(2, dtype=torch.long))


# ---- gate/up GEMM with act(gate) * up in its epilogue -------------------------------------------------------------

def _act64(g: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")


def act_error(g: torch.Tensor, u: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """fp32 error of act(g) * u given exact g and u: both activations are g times a gate factor in [0, 2]
    (the sigmoid, or 1 + tanh computed as 2 - 2 / (exp(2x) + 1)), which fp32 gets to a few ulps of 1
    absolute (cancellation makes it absolute, not relative), then two products: 4u |g u| + 8u |result|."""
    return 4 * U32 * (g * u).abs() + 8 * U32 * exact.abs()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,act,bias", [(1, 48, 64, "silu", False), (5, 128, 96, "silu", True),
                                            (19, 40, 64, "gelu_pytorch_tanh", False)])
@pytest.mark.parametrize("tiles", [None, (16, 16, 64, 4, 3)], ids=["shipped", "tiles"])
def test_gate_up_act_matches_eager(m, n, k, act, bias, dtype, device, tiles):
    """Decode (1 row), a small batch with Qwen-style biases, and prefill-sized tiles (19 rows: BLOCK_M 64)
    with Gemma's tanh GELU; n = 48 and 40 leave partial column tiles. `tiles`: another tiling, as
    bench/bench_gpu.py kernels sweeps them (16 columns, 64-deep K steps: K = 96 ends in a partial one)."""
    x = rand(m, k, seed=10, dtype=dtype, device=device)
    w = rand(2 * n, k, seed=11, scale=k ** -0.5, dtype=dtype, device=device)
    b = rand(2 * n, seed=12, scale=0.3, dtype=dtype, device=device) if bias else None
    out = fk.gate_up_act(x, w, b, act, tiles=tiles)
    assert out.shape == (m, n) and out.dtype == dtype
    # The exact value of what the kernel computes, from the same (rounded) inputs.
    gu = x.double().cpu() @ w.double().cpu().t() + (b.double().cpu() if bias else 0)
    g, u = gu[:, :n], gu[:, n:]
    exact = _act64(g, act) * u
    # fp32 dot products: |error| <= k * u * sum |x_i w_i| for each of gate and up; through act(g) * u that is
    # |act'(g) u| * e_g + |act(g)| * e_u (|act'| <= 1.13 for both activations), plus a few ulps for act itself.
    mags = x.double().cpu().abs() @ w.double().cpu().abs().t()
    e_g, e_u = k * U32 * mags[:, :n], k * U32 * mags[:, n:]
    compute = 1.13 * u.abs() * e_g + _act64(g, act).abs() * e_u + act_error(g, u, exact)
    assert_within(out, exact, compute + (0 if dtype == torch.float32 else ulp(exact, dtype) / 2 + 1e-30),
                  "gate_up_act against the exact value")
    # Eager (F.linear, chunk, act, mul in the dtype) rounds gate, up, act(gate) and the product: it is held to
    # its own larger bound, which the fused one is inside of.
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    eager = _act64(gate, act) * up
    if dtype != torch.float32:
        assert_within(eager, exact, compute + 4 * ulp(exact, dtype) + 1.13 * u.abs() * ulp(g, dtype)
                      + _act64(g, act).abs() * ulp(u, dtype), "eager MLP against the exact value")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_mul_matches_eager(act, dtype, device):
    """The LoRA case's act(gate) * up: fp32 arithmetic rounded once, against the same computed in float64."""
    gu = rand(3, 2 * 40, seed=13, scale=3.0, dtype=dtype, device=device)
    out = fk.act_mul(gu, act)
    g, u = gu.double().cpu()[:, :40], gu.double().cpu()[:, 40:]
    exact = _act64(g, act) * u
    bound = act_error(g, u, exact) + (0 if dtype == torch.float32 else ulp(exact, dtype) / 2 + 1e-30)
    assert_within(out, exact, bound, "act_mul")


def test_unsupported_activation_is_named():
    with pytest.raises(ValueError, match="activation 'relu' is not supported; valid: silu, gelu_pytorch_tanh"):
        fk.gate_up_act(torch.zeros(1, 16), torch.zeros(32, 16), None, "relu")


def test_kernels_compile_for_hopper():
    """sm_90 compiles of the fused forward's kernels at real model shapes (no GPU needed), without register
    spills (LOCAL 0)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"
    res = subprocess.run([sys.executable, str(script), "--arch", "90", "--only", "fused"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "all kernels compiled" in res.stdout and "gate_up_act" in res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line and line.split()[-1].isdigit()]
    assert rows and all(r[-1] == "0" for r in rows), f"register spills: {rows}"
