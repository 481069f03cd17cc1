"""EngineConfig.kv_cache_dtype: the KV cache in another dtype than the model's (engine/kv_dtype.py).

Oracles: fp32/fp64 attention on the dequantized cache (what the kernels must compute exactly, up to their
arithmetic's rounding), torch's own fp32 -> fp8 / bf16 conversions for what the stores write, Tandem's fp32 CPU
kernels (already held to a dense fp64 reference in tests/test_attention_torch.py) on the widened cache, and the
fp32-KV engine on a real checkpoint (SmolLM2-135M-Instruct) for what the bf16 cache changes. The error against
attention on the unquantized K/V and the greedy agreement are measured and printed (docs/engine.md#kv-cache-dtype
quotes them); only bounds that cannot fail by chance are asserted on them.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, kv_dtype
from engine.attention import LayerAttention, TorchPagedAttention, flash, resolve_backend, triton_paged
from engine.attention.torch_paged import store_kv
from engine.config import EngineConfig
from engine.cpu import kernels as cpu_native
from engine.memory import MemoryPlan, kv_blocks
from engine.model_runner import ModelRunner
from engine.models import load_hf_config, model_spec
from engine.sim import PROFILES, SIM_MODELS, CostModel, StepShape
from test_attention_kernels import CASES, DEVICES, TOL, make_inputs, meta_to, reference, rel_err
from test_attention_torch import PREFILL_CHUNKS, dense_reference, prefill_case

FP8 = kv_dtype.FP8_DTYPE
needs_triton = pytest.mark.skipif(not triton_paged.AVAILABLE, reason="triton is not installed")


# ---- names, resolution, refusals ---------------------------------------------------------------------------
def test_unknown_names_are_refused_naming_the_value_and_the_choices():
    for bad in ("int8", "fp8_e5m2", "float16", "bf16"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3; "
                                             f"got '{bad}'"):
            EngineConfig(kv_cache_dtype=bad)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_is_refused_on_cpu_at_config_and_at_engine_construction(name):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}' .*runs on cuda .*not on cpu; on cpu use "
                                         "'auto' or 'bfloat16'"):
        EngineConfig(device="cpu", kv_cache_dtype=name)
    if torch.cuda.is_available():
        return
    config = EngineConfig(kv_cache_dtype=name)  # device "auto": resolved (to cpu here) by the engine
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}' .*not on cpu"):
        LLM(config.model, kv_cache_dtype=name, num_kv_blocks=16)


def test_fp8_on_cpu_through_the_torch_backend_stores_fp8(tiny_model_factory):
    """attention_backend='torch' takes an fp8 cache on CPU (the reference for fp8 storage's accuracy,
    bench/bench_kv_dtype.py): the cache holds float8_e4m3fn, and its first layer's K/V (which no attention read
    has touched yet) is the bf16 cache's first layer rounded to e4m3, value for value."""
    path, _ = tiny_model_factory("llama")
    from test_correctness_hf import make_prompts

    prompt = make_prompts(seed=4, lengths=(17,))[0]
    caches = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=kv, attention_backend="torch", num_kv_blocks=16,
                  block_size=4, enable_prefix_caching=False)
        out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 2
        caches[kv] = llm.engine.core.runner.kv_caches[0]
        llm.shutdown()
    assert caches["fp8"][0].dtype == torch.float8_e4m3fn
    for fp8, bf16 in zip(caches["fp8"], caches["bfloat16"]):  # K, then V
        written = bf16.float().abs().sum(-1) > 0  # the slots the prompt and the first token wrote
        assert written.sum() == 18 * 2  # 17 prompt positions and the first sampled token, 2 KV heads each
        assert torch.equal(fp8.float()[written], bf16.to(torch.float8_e4m3fn).float()[written])


def test_fp8_is_refused_for_a_gguf_model():
    from engine.models.from_gguf import smollm2_gguf

    with pytest.raises(ValueError, match="GGUF model .* kv_cache_dtype='fp8' \\(an fp8 KV cache runs on cuda\\)"):
        EngineConfig(model=str(smollm2_gguf()), kv_cache_dtype="fp8")


def test_resolution():
    cpu = torch.device("cpu")
    resolve = kv_dtype.resolve_kv_dtype
    assert resolve("auto", torch.float32, cpu) == torch.float32
    assert resolve("auto", torch.bfloat16, "sim") == torch.bfloat16
    assert resolve("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve("bfloat16", torch.bfloat16, cpu) == torch.bfloat16  # the same as auto
    assert resolve("fp8", torch.bfloat16, "sim") == resolve("fp8_e4m3", torch.bfloat16, "sim") == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' on cpu needs a float32 or bfloat16 model"):
        resolve("bfloat16", torch.float16, cpu)
    with pytest.raises(ValueError, match="not on cpu"):
        resolve("fp8_e4m3", torch.float32, cpu)
    assert kv_dtype.kv_mode(torch.float32, torch.float32) == kv_dtype.KV_SAME
    assert kv_dtype.kv_mode(torch.float32, torch.bfloat16) == kv_dtype.KV_CAST
    assert kv_dtype.kv_mode(torch.bfloat16, FP8) == kv_dtype.KV_FP8


def test_flash_attn_is_passed_over_or_refused_for_another_kv_dtype():
    """flash-attn reads a cache in the model's dtype only: "auto" passes over it, naming it is an error."""
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, 256, kv_cast=True) == ("triton" if triton_paged.AVAILABLE else "torch")
    if flash.AVAILABLE:
        with pytest.raises(ValueError, match="reads a KV cache in the model's dtype only"):
            resolve_backend("flash_attn", cuda, 256, kv_cast=True)


def test_app_arg_reaches_the_engine_config():
    """`serve run serve_app:app kv_cache_dtype=bfloat16`: an engine field like any other, validated where
    build_app builds the EngineConfig (with the resolved device)."""
    from serve_app.builder import AppConfig

    app = AppConfig(kv_cache_dtype="bfloat16")
    assert app.engine == {"kv_cache_dtype": "bfloat16"}
    assert EngineConfig(device="cpu", **app.engine).kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' .*not on cpu"):
        EngineConfig(device="cpu", **AppConfig(kv_cache_dtype="fp8").engine)


# ---- the stores and the attention kernels --------------------------------------------------------------------
FP8_CASES = ["decode_gqa4_split3", "decode_mqa7_bs12", "prefill_cached_prefix_bs4", "mixed_decode_prefill_gqa4",
             "sliding_window_prefill", "softcap_mixed_window", "gemma_head_dim_256_prefill"]
# Scales that put N(0, 1) values across most of e4m3's range (+-448) without saturating many.
K_SCALE, V_SCALE = 0.02, 0.03


def quantized(x: dict, cache_dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict:
    """The step's inputs with the caches in `cache_dtype` (their contents converted by torch)."""
    out = dict(x)
    out["k_cache"] = kv_dtype.to_cache(x["k_cache"].float(), cache_dtype, k_scale)
    out["v_cache"] = kv_dtype.to_cache(x["v_cache"].float(), cache_dtype, v_scale)
    return out


def dequantized_reference(case, x: dict, meta, k_scale, v_scale):
    """fp64 attention over what the cache holds after the step's store (new rows included), dequantized."""
    def deq(t: torch.Tensor, scale) -> torch.Tensor:
        return kv_dtype.from_cache(t, torch.float64, scale)

    kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
    store_kv(x["k"], x["v"], kc, vc, meta.slot_mapping, k_scale, v_scale)
    ref = TorchPagedAttention(case.window)
    ref.prepare(meta)
    k_rows = deq(kv_dtype.to_cache(x["k"].float(), kc.dtype, k_scale), k_scale)
    v_rows = deq(kv_dtype.to_cache(x["v"].float(), vc.dtype, v_scale), v_scale)
    return ref.forward(x["q"].double(), k_rows, v_rows, deq(kc, k_scale), deq(vc, v_scale), meta,
                       case.head_dim ** -0.5, LayerAttention(case.window, case.softcap)), kc, vc


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FP8_CASES)
def test_triton_fp8_kernels_match_attention_on_the_dequantized_cache(name, dtype, device):
    """The store writes torch's own e4m3 rounding of x / scale (bit for bit); attention over the fp8 cache
    equals fp64 attention over its dequantized values within the dtype's usual kernel tolerance. The error
    against attention on the unquantized K/V (what e4m3's 3-bit mantissa costs on these N(0, 1) inputs) is
    printed (docs/engine.md#kv-cache-dtype)."""
    case = CASES[name]
    x, meta = make_inputs(case, dtype, seed=FP8_CASES.index(name))
    k_scale, v_scale = torch.tensor(K_SCALE), torch.tensor(V_SCALE)
    xq = quantized(x, FP8, k_scale, v_scale)
    want, want_k, want_v = dequantized_reference(case, xq, meta, k_scale, v_scale)
    dev = {n: t.to(device) for n, t in xq.items()}
    dmeta = meta_to(meta, device)
    ks, vs = k_scale.to(device), v_scale.to(device)
    triton_paged.store_kv_triton(dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], dmeta.slot_mapping, ks, vs)
    assert torch.equal(dev["k_cache"].cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(dev["v_cache"].cpu().view(torch.uint8), want_v.view(torch.uint8))
    out = torch.full_like(dev["q"], float("nan"))
    triton_paged.paged_attention_triton(dev["q"], dev["k_cache"], dev["v_cache"], dmeta, case.head_dim ** -0.5,
                                        case.window, block_n=16, num_splits=case.splits, out=out,
                                        softcap=case.softcap, k_scale=ks, v_scale=vs)
    assert not out.isnan().any()
    assert rel_err(out, want) < TOL[dtype]
    unquantized, _, _ = reference(case, x, meta)
    err = rel_err(out, unquantized)
    print(f"\n{name} {dtype}: fp8 KV vs attention on the unquantized K/V: {err:.4f} relative L2")
    assert err < 0.1  # e4m3 keeps every value within 1/16 of itself: far below this, or the scales are wrong


@pytest.mark.parametrize("name", ["decode_gqa4_split3", "mixed_decode_prefill_gqa4", "softcap_mixed_window"])
def test_torch_backend_reads_fp8_and_bf16_caches(name):
    """The reference backend (and the CPU one's SDPA fallback): stores converted, dequantizes on gather."""
    case = CASES[name]
    x, meta = make_inputs(case, torch.float32, seed=3)
    for cache_dtype, scales in ((FP8, (torch.tensor(K_SCALE), torch.tensor(V_SCALE))), (torch.bfloat16, (None, None))):
        xq = quantized(x, cache_dtype, *(s if s is not None else torch.tensor(1.0) for s in scales))
        want, _, _ = dequantized_reference(case, xq, meta, *scales)
        backend = TorchPagedAttention(case.window)
        backend.prepare(meta)
        out = backend.forward(xq["q"], xq["k"], xq["v"], xq["k_cache"], xq["v_cache"], meta, case.head_dim ** -0.5,
                              LayerAttention(case.window, case.softcap), k_scale=scales[0], v_scale=scales[1])
        assert rel_err(out, want) < TOL[torch.float32], cache_dtype


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["decode_gqa2_bs4_ragged", "mixed_decode_prefill_gqa4", "sliding_window_prefill"])
def test_triton_reads_a_bf16_cache_under_fp32_queries(name, device):
    """kv_cache_dtype="bfloat16" with an fp32 model on CUDA: the store rounds to nearest even (torch's cast,
    bit for bit; the interpreter's own cast truncates), attention widens exactly."""
    case = CASES[name]
    x, meta = make_inputs(case, torch.float32, seed=4)
    xq = quantized(x, torch.bfloat16, None, None)
    want, want_k, want_v = dequantized_reference(case, xq, meta, None, None)
    dev = {n: t.to(device) for n, t in xq.items()}
    dmeta = meta_to(meta, device)
    backend = triton_paged.TritonPagedAttention(case.window, block_n=16)
    out = backend.forward(dev["q"], dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], dmeta,
                          case.head_dim ** -0.5, LayerAttention(case.window, case.softcap))
    assert torch.equal(dev["k_cache"].cpu(), want_k) and torch.equal(dev["v_cache"].cpu(), want_v)
    assert rel_err(out, want) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_fused_rope_store_writes_the_cache_dtype(cache_dtype, device):
    """The fused forward's RoPE + store kernel writes exactly what the model-dtype store followed by torch's
    conversion writes (fp8: with the layer's scales); q is unchanged by the cache's dtype."""
    from engine.models import fused_kernels as fk
    from test_fused_kernels import rope_case

    (h, hkv, d), qkv, positions, cos, sin, slots, _, caches = rope_case("llama_gqa2", torch.float32, device)
    k_scale, v_scale = torch.tensor(0.05, device=device), torch.tensor(0.07, device=device)
    kc, vc = (c.clone() for c in caches)
    q_ref = fk.rope_store(qkv, positions, cos, sin, h, hkv, d, kc, vc, slots)
    scales = (k_scale, v_scale) if cache_dtype == FP8 else (None, None)
    kq, vq = (kv_dtype.to_cache(c, cache_dtype, s) for c, s in zip(caches, scales))
    want_k, want_v = (kv_dtype.to_cache(c, cache_dtype, s) for c, s in zip((kc, vc), scales))
    q = fk.rope_store(qkv, positions, cos, sin, h, hkv, d, kq, vq, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(q, q_ref)
    assert torch.equal(kq.cpu().view(torch.uint8), want_k.cpu().view(torch.uint8))
    assert torch.equal(vq.cpu().view(torch.uint8), want_v.cpu().view(torch.uint8))


@needs_triton
@pytest.mark.skipif(not triton_paged.INTERPRETED, reason="CPU tensors need Triton's interpreter")
@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_fused_forward_equals_eager_over_the_same_cache_dtype(cache_dtype):
    """One decode step through the fused forward and through the eager layers on the Triton backend, both over
    caches of `cache_dtype` (fp8 with non-unit scales set on every layer's Attention): both store and read
    the same values, so their hidden states agree within fp32 reordering (as in tests/test_fused_forward.py)."""
    from engine.attention import AttentionMetadata
    from test_fused_forward import random_model

    outs = []
    for fused in (False, True):
        model, spec = random_model("llama", 2, fused, dtype=torch.float32)
        for layer in model.layers:
            layer.self_attn.k_scale.fill_(0.05)
            layer.self_attn.v_scale.fill_(0.07)
        g = torch.Generator().manual_seed(3)
        kv = [tuple(kv_dtype.to_cache(torch.randn(8, 4, spec.num_kv_heads, spec.head_dim, generator=g),
                                      cache_dtype, torch.tensor(s)) for s in (0.05, 0.07)) for _ in range(2)]
        meta = AttentionMetadata(torch.tensor([5, 20]), torch.tensor([0, 1, 2], dtype=torch.int32),
                                 torch.tensor([6, 10], dtype=torch.int32),
                                 torch.tensor([[1, 0, 0], [3, 4, 5]], dtype=torch.int32), 4, [1, 1], [6, 10])
        with torch.inference_mode():
            model.layers[0].self_attn.backend.prepare(meta)
            outs.append((model(torch.tensor([7, 11]), torch.tensor([5, 9]), kv, meta), kv))
    (eager, eager_kv), (fused_out, fused_kv) = outs
    err = (fused_out - eager).norm(dim=-1) / eager.norm(dim=-1)
    assert err.max().item() < 1e-5, err
    for (ek, ev), (fk_, fv) in zip(eager_kv, fused_kv):  # the new rows were stored the same way
        assert torch.equal(ek.view(torch.uint8), fk_.view(torch.uint8))
        assert torch.equal(ev.view(torch.uint8), fv.view(torch.uint8))


def test_fp8_needs_the_scales():
    case = CASES["decode_mha_bs16"]
    x, meta = make_inputs(case, torch.float32, seed=0)
    xq = quantized(x, FP8, torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(ValueError, match="needs the layer's k_scale and v_scale"):
        triton_paged.paged_attention_triton(xq["q"], xq["k_cache"], xq["v_cache"], meta, 0.1)


def test_block_copies_and_offload_move_fp8_bytes():
    """Copy-on-write and the host pool copy an fp8 cache as bytes (CPU index_copy_ has no fp8 kernel)."""
    from engine.kv_offload import KVOffloader, copy_blocks
    from engine.scheduler import SwapOp

    cache = kv_dtype.to_cache(torch.randn(2, 2, 6, 4, 1, 8) * 50, FP8, None)  # [L, 2, N, bs, Hkv, D]
    before = cache.clone()
    copy_blocks(cache, [(1, 4)])
    assert torch.equal(cache[:, :, 4].view(torch.uint8), before[:, :, 1].view(torch.uint8))
    pool = KVOffloader(cache, num_cpu_blocks=3)
    pool.run([SwapOp("out", [0, 2], [1, 2])])
    cache[:, :, [0, 2]] = kv_dtype.to_cache(torch.zeros(2, 2, 2, 4, 1, 8), FP8, None)
    pool.run([SwapOp("in", [3, 5], [1, 2])])
    assert torch.equal(cache[:, :, [3, 5]].view(torch.uint8), before[:, :, [0, 2]].view(torch.uint8))


# ---- the CPU kernels: fp32 queries over a bf16 cache -----------------------------------------------------------
ISAS = pytest.mark.parametrize("isa", cpu_native.isas(), ids=list(cpu_native.isas()))


@ISAS
@pytest.mark.parametrize("dim", [64, 128, 48])  # 64 / 128: the AVX-512 block path; 48: the per-row loops
@pytest.mark.parametrize("window,softcap", [(0, None), (37, None), (0, 3.0)])
def test_cpu_decode_reads_a_bf16_cache_under_fp32_queries(isa, dim, window, softcap):
    """Widening bf16 is exact and the rest is the fp32 path: within the fp32 kernel's own bound (2e-5) of the
    dense fp64 reference on the widened cache, at every level; on the AVX-512 block path bit for bit the fp32
    kernel's result on the widened cache (the same instructions on the same fp32 values; the portable loops
    are vectorized by the compiler, which may sum a bf16 row in another order)."""
    kernel = cpu_native.load(isa)
    torch.manual_seed(5)
    heads, kv_heads, nblocks, bs = 9, 3, 200, 16
    lens = [1, 17, 300, 512, 45, 130]
    k_cache, v_cache = (torch.randn(nblocks, bs, kv_heads, dim).bfloat16() for _ in range(2))
    tables = torch.stack([torch.randperm(nblocks)[:-(-max(lens) // bs)] for _ in lens]).int()
    q, seq_lens = torch.randn(len(lens), heads, dim), torch.tensor(lens, dtype=torch.int32)
    out = kernel.paged_decode(q, k_cache, v_cache, tables, seq_lens, dim ** -0.5, window, softcap or 0.0)
    assert out.dtype == torch.float32
    for b, n in enumerate(lens):
        rows = tables[b].long()
        k, v = k_cache[rows].float().flatten(0, 1)[:n], v_cache[rows].float().flatten(0, 1)[:n]
        ref = dense_reference(q[b:b + 1], k, v, torch.tensor([n - 1]), dim ** -0.5, window or None, softcap)
        torch.testing.assert_close(out[b:b + 1], ref, atol=2e-5, rtol=2e-5)
    if isa == "avx512" and dim in (64, 128):
        want = kernel.paged_decode(q, k_cache.float(), v_cache.float(), tables, seq_lens, dim ** -0.5, window,
                                   softcap or 0.0)
        assert torch.equal(out, want)


@ISAS
@pytest.mark.parametrize("dim,heads,kv_heads,bs", [(64, 9, 3, 16), (128, 4, 4, 32), (256, 4, 1, 16)])
@pytest.mark.parametrize("window,softcap", [(0, None), (37, None), (0, 2.0)])
def test_cpu_prefill_reads_a_bf16_cache_under_fp32_queries(isa, dim, heads, kv_heads, bs, window, softcap):
    """Every level's prefill path on fp32 queries over a bf16 cache: the fp32 kernel's bound (2e-5) against the
    dense fp64 reference on the widened cache, and bit for bit that kernel's result on the widened cache (K and
    V are widened as they are packed; the micro-kernels then run on the same fp32 values)."""
    kernel, args = prefill_case(isa, torch.float32, dim, heads, kv_heads, bs, seed=6)
    q, k_cache, v_cache, tables, starts, *lens = args
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    outs = []
    for kc, vc in ((k16, v16), (k16.float(), v16.float())):
        out = torch.full(q.shape, float("nan"))
        kernel.paged_prefill(q, kc, vc, tables, starts, *lens, dim ** -0.5, window, softcap or 0.0, out)
        outs.append(out)
    assert outs[0][0].isnan().all() and outs[0][-2:].isnan().all()  # the step's decode rows are left alone
    assert torch.equal(outs[0][1:-2], outs[1][1:-2])
    for c, ((n, seq_len), start) in enumerate(zip(PREFILL_CHUNKS, starts.tolist())):
        rows = tables[c].long()
        k, v = k16[rows].double().flatten(0, 1)[:seq_len], v16[rows].double().flatten(0, 1)[:seq_len]
        ref = dense_reference(q[start:start + n].double(), k, v, torch.arange(seq_len - n, seq_len), dim ** -0.5,
                              window or None, softcap)
        torch.testing.assert_close(outs[0][start:start + n], ref, atol=2e-5, rtol=2e-5)


def test_cpu_kernels_refuse_other_mixes():
    kernel = cpu_native.load()
    q = torch.randn(1, 2, 64).bfloat16()
    cache = torch.randn(2, 16, 2, 64)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        kernel.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                            0.1, 0, 0.0)


# ---- the engine on CPU: a float32 model with a bf16 cache ----------------------------------------------------
def test_bf16_cache_halves_the_bytes_per_block_and_doubles_the_blocks():
    """Per-block bytes exactly half; from one memory plan exactly twice the blocks (the block count from a
    measured plan moves with the measured activation peak, checked below on the real model)."""
    spec = model_spec(load_hf_config(EngineConfig().model_dir))
    fp32 = ModelRunner.kv_bytes_per_block(spec, 16, torch.float32)
    bf16 = ModelRunner.kv_bytes_per_block(spec, 16, torch.bfloat16)
    assert fp32 == 2 * bf16
    plan = MemoryPlan(usable=64 * fp32 + 123, in_use=0, activation_peak=0, graph_pool=0, source="modelled")
    assert kv_blocks(plan, bf16, 10**9, None) == 2 * kv_blocks(plan, fp32, 10**9, None) == 128


def test_tiny_model_runs_with_a_bf16_cache_on_the_cpu_and_torch_backends():
    """The embedded model (head size 32: the native decode kernel's per-row loops, prefill through SDPA on the
    widened cache) on both CPU backends: the cache is bf16 and greedy output matches fp32 KV's for the first
    tokens of each prompt (asserted: the first token of most prompts, which one bf16 rounding of K/V cannot
    move on every prompt at once)."""
    prompts = ["def main():", "The quick brown fox", "import os\nimport sys\n", "class Point:", "# Return the"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = _generate(dict(), prompts, params)[0]
    for backend in ("cpu", "torch"):
        outs, llm_stats = _generate(dict(kv_cache_dtype="bfloat16", attention_backend=backend), prompts, params)
        assert llm_stats["kv_dtype"] == torch.bfloat16
        agree = sum(a[0] == b[0] for a, b in zip(outs, ref))
        assert agree >= len(prompts) - 1, (backend, outs, ref)


def _generate(kw: dict, prompts, params):
    llm = LLM(EngineConfig().model, device="cpu", num_kv_blocks=64, max_num_seqs=8, **kw)
    try:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        return outs, {"kv_dtype": llm.engine.core.runner.kv_cache.dtype}
    finally:
        llm.shutdown()


def test_pipeline_stages_hold_bf16_caches_and_match_the_single_engine(tiny_model_factory):
    """Pipeline stages allocate their cache slices in the KV dtype too (and hand hidden states on in the
    model's): two local stages give the single engine's greedy tokens with the same bf16 cache."""
    from engine.pipeline import LocalStageGroup, PipelineEngine
    from test_correctness_hf import make_prompts
    from test_pipeline_parallel import GREEDY, run_engine

    path, _ = tiny_model_factory("llama", num_hidden_layers=4)
    prompts = make_prompts(seed=1)
    kw = dict(model=str(path), block_size=4, max_num_batched_tokens=16, kv_cache_dtype="bfloat16")
    single = LLM(**kw)
    try:
        want = [o.token_ids for o in single.generate(prompts, GREEDY)]
    finally:
        single.shutdown()
    engine = PipelineEngine(EngineConfig(pipeline_parallel_size=2, **kw), LocalStageGroup)
    try:
        assert [w.kv_cache.dtype for w in engine.core.runner.stages.workers] == [torch.bfloat16] * 2
        assert [o.token_ids for o in run_engine(engine, prompts, GREEDY)] == want
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_cuda_engine_runs_an_fp8_cache():
    """On a GPU with fp8 conversions: the cache is fp8, the fused forward and its decode graphs run over it,
    and greedy output agrees with the model-dtype cache's on the first token of most prompts (the embedded
    model, trained: its argmax margins are not a random model's near-ties)."""
    if torch.cuda.get_device_capability() < kv_dtype.FP8_MIN_CAPABILITY:
        with pytest.raises(ValueError, match="compute capability 8.9"):
            LLM(EngineConfig().model, device="cuda", kv_cache_dtype="fp8", num_kv_blocks=64)
        return
    prompts = ["def main():", "The quick brown fox", "import os\nimport sys\n", "class Point:", "# Return the",
               "What does os.path.join do?", "Open a file and", "The logging module"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(EngineConfig().model, device="cuda", kv_cache_dtype=kv, num_kv_blocks=256, max_num_seqs=8)
        try:
            assert (llm.engine.core.runner.kv_cache.dtype == FP8) == (kv == "fp8")
            outs[kv] = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.stats()["graph_steps"] > 0
        finally:
            llm.shutdown()
    first = sum(a[0] == b[0] for a, b in zip(outs["fp8"], outs["auto"]))
    print(f"\nfp8 vs model-dtype KV on cuda: first token {first}/{len(prompts)}, "
          f"{sum(a == b for a, b in zip(outs['fp8'], outs['auto']))}/{len(prompts)} identical")
    assert first >= len(prompts) - 2


SMOL_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is in two sentences.",
    "List three prime numbers.", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "What does a CPU cache do?", "Translate 'good morning' into Spanish.", "Summarize the plot of Hamlet briefly.",
    "How do vaccines work?", "Name the planets of the solar system.", "What is 17 times 23?",
    "Suggest a name for a pet turtle.", "What is photosynthesis?", "Describe a rainbow to a child.",
    "Write a Python function that reverses a string.",
]
SMOL_TOKENS = 32


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct (as tests/test_real_model.py loads it) and its chat-templated prompts."""
    from transformers import AutoTokenizer

    from engine.models.from_gguf import smollm2_dir

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in SMOL_QUESTIONS]
    return str(model_dir), prompts


def _smol_run(model_dir: str, prompts, **kw):
    llm = LLM(model_dir, device="cpu", dtype="float32", cpu_kv_cache_bytes=256 << 20, max_num_seqs=16, **kw)
    try:
        runner = llm.engine.core.runner
        cache = {"dtype": runner.kv_cache.dtype, "blocks": runner.num_kv_blocks,
                 "block_bytes": runner.kv_cache.nbytes // runner.num_kv_blocks, "plan_bytes": runner.memory.kv_bytes}
        scored = llm.generate(prompts[:4], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        outs = llm.generate(prompts, SamplingParams(max_tokens=SMOL_TOKENS, temperature=0, ignore_eos=True))
        prompt_lp = [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in scored]
        return [o.token_ids for o in outs], prompt_lp, cache
    finally:
        llm.shutdown()


def test_smollm2_bf16_cache_against_fp32_cache(smol):
    """The real model in fp32 with the KV cache in bf16 against the fp32 cache, same budget
    (cpu_kv_cache_bytes): a bf16 tensor at half the bytes a block, so about twice the blocks (the budget less
    the measured activation peak, which moves from run to run), prompt logprobs within a small distance, and
    greedy agreement over 16 prompts measured and printed. Asserted on the agreement only: the first generated
    token of most prompts (one bf16 rounding of K/V cannot flip the argmax of most prompts at once)."""
    model_dir, prompts = smol
    ref, ref_lp, ref_cache = _smol_run(model_dir, prompts)
    outs, lp, cache = _smol_run(model_dir, prompts, kv_cache_dtype="bfloat16")
    diffs = [abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y)]
    lp_diff = max(diffs)
    first = sum(a[0] == b[0] for a, b in zip(outs, ref))
    same = sum(a == b for a, b in zip(outs, ref))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), SMOL_TOKENS) for a, b in zip(outs, ref)]
    agree_tokens = sum(prefix) / (len(prompts) * SMOL_TOKENS)
    print(f"\nSmolLM2-135M fp32, bf16 KV vs fp32 KV over {len(prompts)} prompts x {SMOL_TOKENS} greedy tokens: "
          f"{same}/{len(prompts)} identical, first token {first}/{len(prompts)}, {agree_tokens:.1%} of tokens "
          f"before the first divergence; prompt logprobs |diff| max {lp_diff:.4f}, mean "
          f"{sum(diffs) / len(diffs):.4f} over {len(diffs)} tokens; KV blocks "
          f"{ref_cache['blocks']} -> {cache['blocks']} for 256 MiB")
    assert (ref_cache["dtype"], cache["dtype"]) == (torch.float32, torch.bfloat16)
    assert ref_cache["block_bytes"] == 2 * cache["block_bytes"]
    for c in (ref_cache, cache):
        assert c["blocks"] == c["plan_bytes"] // c["block_bytes"]
    assert first >= len(prompts) - 2
    assert lp_diff < 0.5  # a logprob moved by a bf16 rounding of K/V, not a broken cache (those are off by units)


# ---- the simulated device: fp8 prices KV at one byte a value -------------------------------------------------
LLAMA8B = str(SIM_MODELS / "llama-3.1-8b")


def test_sim_fp8_cache_doubles_the_blocks_and_halves_the_decode_kv_read():
    """Llama-3.1-8B on the simulated H100: the modelled memory plan gives an fp8 cache twice the blocks of a
    bf16 one (the same KV budget at half the bytes a block), and a decode step's KV read costs half."""
    def blocks(kv: str) -> tuple[int, float]:
        llm = LLM(LLAMA8B, device="sim", sim_gpu="h100", kv_cache_dtype=kv, max_num_seqs=256, max_model_len=131072)
        try:
            runner = llm.engine.core.runner
            return runner.num_kv_blocks, runner.cost.model.kv_bytes_per_token
        finally:
            llm.shutdown()
    bf16_blocks, bf16_bytes = blocks("auto")
    fp8_blocks, fp8_bytes = blocks("fp8")
    assert bf16_bytes == 2 * fp8_bytes == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert fp8_blocks in (2 * bf16_blocks, 2 * bf16_blocks + 1), (bf16_blocks, fp8_blocks)
    spec = model_spec(load_hf_config(LLAMA8B))
    bf16, fp8 = (CostModel(spec, 2, PROFILES["h100"], kv_dtype_bytes=b) for b in (2, 1))
    decode = StepShape([1] * 64, [4096] * 64, 64)  # 64 rows of 4k context: attention is memory-bound
    assert fp8.attention_s(decode) == pytest.approx(bf16.attention_s(decode) / 2)
    assert fp8.gemm_s(decode) == bf16.gemm_s(decode)  # the weights are not the cache


def test_sim_refuses_fp8_on_a_gpu_without_fp8():
    with pytest.raises(ValueError, match="sim_gpu='a100' lacks"):
        LLM(LLAMA8B, device="sim", sim_gpu="a100", kv_cache_dtype="fp8", max_model_len=4096)
