"""The Triton int4 GEMM (engine/models/int4_triton.py), GPTQ / AWQ checkpoints' path on CUDA, on CPU tensors under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA) and compiled on CUDA (marked gpu).

The oracle is the checkpoint's own dequantization, scale * (q - z), computed here from codes, zero points and
scales packed into each format by tests/test_int4_checkpoint.py's writers (the formats' definitions, not the
loader's unpacking), multiplied in float64. The kernel never rounds a weight: it sums exact products (bf16 /
fp16 x times a small integer) or fp32 products rounded once, scaled per group, in fp32 in some order, so

    |y - exact| <= gamma_K * sum_k |x_k w_k|,   gamma_K = K u / (1 - K u), u = 2^-24

(any order of K fp32 additions, the per-plane scaling and the split-K sum counted among the K), and a bf16 /
fp16 output adds its one rounding: half an ulp of the result. Model level: a tiny checkpoint on the CUDA code
path (the fused forward with the int4 linears, as build_model picks it on a GPU) gives Hugging Face's logits on
the same exact weights within fp32 summation error, the CPU's Q4_1 path's where their weights agree, and HF's
greedy tokens through the whole engine.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, triton_paged
from engine.cpu.quant import QuantLinear
from engine.models import int4_triton
from engine.models.int4_loader import int4_scheme, unpack
from engine.models.int4_triton import Int4Linear
from engine.models.loader import build_model, load_hf_config, model_spec
from test_correctness_hf import assert_matches_hf, make_prompts
from test_int4_checkpoint import hf_on, pack_awq, pack_gptq, qconfig, quantize_checkpoint

pytestmark = pytest.mark.skipif(not triton_paged.AVAILABLE, reason="triton is not installed")
interpreted = pytest.mark.skipif(not triton_paged.INTERPRETED,
                                 reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set without CUDA)")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
U32 = 2.0 ** -24
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")  # the CPU Q4_1 path compared against: its exact path


def checkpoint_linear(n: int, k: int, group: int, fmt: str, gen: torch.Generator):
    """Random codes q [N, K], zero points z [G, N] and fp16 scales of one linear (groups of `group`, the last one
    short when it does not divide K), packed in `fmt` ("gptq" v1, "gptq_v2", "awq") and read back by the loader's
    unpack; returns (q, z, scales, unpacked (q, z, scales))."""
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # v1 stores z - 1, so its zero points run 1..16 (16: the stored 15); the others 0..15
    z = torch.randint(1 if fmt == "gptq" else 0, 17 if fmt == "gptq" else 16, (groups, n), generator=gen,
                      dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.001).half()
    qweight, qzeros = pack_awq(q, z) if fmt == "awq" else pack_gptq(q, z - (1 if fmt == "gptq" else 0))
    method = "awq" if fmt == "awq" else "gptq"
    scheme = int4_scheme(qconfig(method, group if group < k else -1, sym=False, fmt=fmt))
    return q, z, scales, unpack(scheme, qweight, qzeros, scales)


def dequantized(q, z, scales, group: int) -> torch.Tensor:
    """The checkpoint's weight [N, K] in float64: scale * (q - z) of each input's group."""
    of = torch.arange(q.shape[1]) // group
    return (q.double() - z.double().t()[:, of]) * scales.double().t()[:, of]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at |x| (float64), subnormals floored."""
    e = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(e - MANTISSA[dtype])


CASES = [  # M, N, K, group (K: one group), format, bias, dtype
    (1, 96, 256, 32, "gptq", False, torch.float32),  # groups of 32: per-plane scales; decode, split-K
    (3, 80, 576, 128, "gptq", True, torch.float32),  # a short last group (576 = 4.5 x 128), a padded chunk
    (16, 64, 320, 320, "awq", True, torch.bfloat16),  # one group, K not a multiple of the 128-input chunk
    (33, 200, 256, 64, "awq", False, torch.bfloat16),  # 64-row tiles, a partial column tile
    (1, 48, 1024, 128, "gptq_v2", True, torch.bfloat16),  # eight chunks split eight ways, summed with the bias
    (16, 96, 256, 32, "gptq", True, torch.float16),
    (3, 64, 128, 128, "gptq_v2", True, torch.bfloat16),  # one chunk: no split, the bias added in the GEMM
    (33, 64, 256, 32, "gptq", False, torch.float32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,group,fmt,bias,dtype", CASES)
def test_int4_gemm_equals_the_checkpoints_weights_through_an_exact_matmul(m, n, k, group, fmt, bias, dtype, device):
    gen = torch.Generator().manual_seed(m * 7 + k)
    q, z, scales, (uq, uz, us) = checkpoint_linear(n, k, group, fmt, gen)
    weight = int4_triton.pack(uq, uz, us, group if group < k else None, device)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    out = int4_triton.int4_matmul(x.to(device), weight, b.to(device) if bias else None).cpu()
    assert out.shape == (m, n) and out.dtype == dtype
    w = dequantized(q, z, scales, group)
    exact = x.double() @ w.t() + (b.double() if bias else 0)
    gamma = (k + 1) * U32 / (1 - (k + 1) * U32)  # K products and the bias
    bound = gamma * (x.double().abs() @ w.abs().t() + (b.double().abs() if bias else 0))
    if dtype != torch.float32:
        bound = bound + ulp(exact.abs() + bound, dtype) / 2
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {(err - bound).max().item():.3e} past its bound"


def test_the_cases_cover_split_and_unsplit_launches():
    """The oracle above checks both epilogues (split-K partials summed by the second kernel, and the GEMM's own);
    at Llama-3.2-1B's shapes, o_proj splits K at decode, gate/up (16384 outputs) not at prefill."""
    splits = {int4_triton.tiles(m, n, -(-k // int4_triton.CHUNK))[2] for m, n, k, *_ in CASES}
    assert 1 in splits and max(splits) > 1
    assert int4_triton.tiles(1, 2048, 16)[2] > 1 and int4_triton.tiles(512, 16384, 16)[2] == 1


def test_pack_refuses_disagreeing_shapes():
    q = torch.zeros(16, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need scales and zeros of \\(2, 16\\); got \\(3, 16\\)"):
        int4_triton.pack(q, torch.zeros(3, 16, dtype=torch.int32), torch.ones(3, 16).half(), 128)
    with pytest.raises(ValueError, match="groups of 40"):
        int4_triton.pack(q, torch.zeros(7, 16, dtype=torch.int32), torch.ones(7, 16).half(), 40)


# ---- whole models on the CUDA code path ------------------------------------------------------------------------

def prefill_logits(model, spec, ids: torch.Tensor, device: str) -> torch.Tensor:
    """One sequence's prefill through `model` (block size 4, a fresh cache) -> fp32 logits [T, vocab]."""
    t, bs = ids.shape[0], 4
    blocks = -(-t // bs)
    kv = [(torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim, device=device),
           torch.zeros(blocks, bs, spec.num_kv_heads, spec.head_dim, device=device)) for _ in range(spec.num_layers)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.arange(t, device=device), torch.tensor([0, t], **i32), torch.tensor([t], **i32),
                             torch.arange(blocks, **i32)[None], bs, [t], [t])
    with torch.inference_mode():
        model.layers[0].self_attn.backend.prepare(meta)
        return model.logits(model(ids.to(device), torch.arange(t, device=device), kv, meta)).cpu()


def build(qdir, device: str, gpu: bool):
    """The checkpoint's fp32 model on `device` on the Triton attention backend: with `gpu` the GPU kernels (fused
    forward, Int4Linears), else the CPU's path."""
    config = load_hf_config(str(qdir))
    spec = model_spec(config)
    backend = triton_paged.TritonPagedAttention(sliding_window=spec.sliding_window)
    model = build_model(str(qdir), config, spec, 64, backend, torch.float32, torch.device(device),
                        fused=gpu or None)
    return model, spec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,method,group,sym,fmt", [
    ("llama", "gptq", 32, True, "gptq"),
    ("qwen2", "gptq", -1, True, "gptq"),  # q/k/v biases; one group a row
    ("qwen3", "gptq", 32, False, "gptq_v2"),  # asymmetric: exact here, the min rounded on the CPU's Q4_1
    ("llama", "awq", 64, False, "gptq"),
])
def test_cuda_path_logits_equal_hf_on_the_checkpoints_exact_weights(tiny_model_factory, tmp_path, family, method,
                                                                     group, sym, fmt, device):
    """fp32 logits of a 12-token prefill: the fused forward with Int4Linears (q/k/v and gate/up stacked) against
    HF's on scale * (q - z), and for symmetric GPTQ (where Q4_1 holds the same weights) against the CPU's Q4_1
    model; within fp32 summation error reordered (1e-5 of each row's norm, as tests/test_fused_forward.py)."""
    path, hf = tiny_model_factory(family)
    qdir = tmp_path / f"{family}-{method}"
    refs = quantize_checkpoint(path, qdir, method, group, sym, fmt, exact=True)
    model, spec = build(qdir, device, gpu=True)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 4 * spec.num_layers and model.fused is not None
    ids = torch.tensor(make_prompts(seed=4, lengths=(12,))[0])
    got = prefill_logits(model, spec, ids, device)
    with torch.no_grad():
        want = hf_on(hf, refs)(ids[None]).logits[0].float()
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max().item() < 1e-5, f"against HF: relative error {err.max().item():.2e}"
    if sym and device == "cpu":  # the CPU's model (Q4_1, its own kernels), attention still interpreted Triton
        cpu, _ = build(qdir, "cpu", gpu=False)
        assert any(isinstance(m, QuantLinear) for m in cpu.modules()) and cpu.fused is None
        q4 = prefill_logits(cpu, spec, ids, "cpu")
        err = (got - q4).norm(dim=-1) / q4.norm(dim=-1)
        assert err.max().item() < 1e-5, f"against the CPU's Q4_1 path: relative error {err.max().item():.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_engine_serves_int4_through_the_triton_gemm(tiny_model_factory, tmp_path, device):
    """The whole engine on the CUDA code path (fused forward, Int4Linears; decode graphs, emulated on CPU): fp32
    greedy tokens equal HF's on the exact weights (near-ties aside, as test_correctness_hf asserts them)."""
    path, hf = tiny_model_factory("qwen2")
    qdir = tmp_path / "qwen2-awq"
    refs = quantize_checkpoint(path, qdir, "awq", 32, False, exact=True)
    llm = LLM(str(qdir), device=device, dtype="float32", attention_backend="triton", fused_forward=True,
              block_size=4, max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.fused is not None and any(isinstance(m, Int4Linear) for m in model.modules())
    if device == "cpu":
        llm.engine.runner.capture_graphs(max_batch_size=4, emulate=True)
    prompts = make_prompts(seed=5, lengths=(3, 9, 20))
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    reference = hf_on(hf, refs)
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(reference, prompt, out.token_ids, 6)
    assert llm.stats()["graph_steps"] > 0
    llm.shutdown()


def test_kernels_compile_for_hopper():
    """sm_90 compiles of the int4 GEMM at Llama-3.2-1B's shapes (no GPU needed), without register spills."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"
    res = subprocess.run([sys.executable, str(script), "--arch", "90", "--only", "int4"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "all kernels compiled" in res.stdout and "int4 gate_up M1" in res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line and line.split()[-1].isdigit()]
    assert rows and all(r[-1] == "0" for r in rows), f"register spills: {rows}"
