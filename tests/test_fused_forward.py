"""The fused CUDA forward (engine/models/fused_forward.py), run on CPU tensors with its Triton kernels under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA):

- launches: one decode step on the CUDA code path counted per decoder layer (PyTorch operators that launch a
  kernel plus Triton launches, views apart; tests/launch_count.py) is at most 8 for Llama and Qwen2
  and at most 10 for Gemma 3, equals the plan the simulated device prices (fused_forward.layer_launches), and
  the eager decoder it replaces is over the bound (so this test fails on the old path). Attention's key-range
  split is forced to what an H200 would choose, so its merge is counted as on a GPU.
- logits: the fused forward's fp32 greedy output equals Hugging Face transformers' on the same weights, in the
  whole engine (chunked prefills and decodes, replayed from emulated graphs where graph_max is set).
- the fused path is refused by name where it cannot run, and stays off on the CPU path.
"""

from __future__ import annotations

import pytest
import torch

import launch_count
import tiny_models
from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, triton_paged
from engine.models import fused_forward
from engine.models.decoder import DecoderLM
from engine.models.loader import model_spec, rope_tables
from test_correctness_hf import assert_matches_hf, make_prompts

pytestmark = pytest.mark.skipif(not triton_paged.AVAILABLE, reason="triton is not installed")
interpreted = pytest.mark.skipif(not triton_paged.usable_on(torch.device("cpu")),
                                 reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set without CUDA)")

H200_SMS = 132
BOUND = {"llama": 8, "qwen2": 8, "gemma3_text": 10}  # issue 46's targets, kernels per layer


def h200_splits(device, programs: int) -> int:
    """triton_paged._auto_splits as it decides on an H200 (132 SMs): two waves of programs."""
    return max(1, min(triton_paged.MAX_SPLITS, -(-2 * H200_SMS // programs)))


def random_model(family: str, num_layers: int, fused: bool, dtype=torch.bfloat16, device: str = "cpu"):
    """A `family` decoder of `num_layers` random layers (tiny_models' config), on the Triton backend, fused or
    eager; plus its spec."""
    config = tiny_models.FAMILIES.get(family) or tiny_models.EXTRA_FAMILIES[family]
    config = config()
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i % 2] for i in range(num_layers)]
    spec = model_spec(config)
    backend = triton_paged.TritonPagedAttention(sliding_window=spec.sliding_window)
    torch.manual_seed(0)
    model = DecoderLM(spec, None, backend)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model = model.to(device=device, dtype=dtype).eval()
    # fp32 RoPE tables, kept out of the dtype cast (as engine/models/loader.build_model does)
    model.rotary = rope_tables(config, spec, 64, "full_attention" if spec.local_rope else None).to(device)
    model.rotary_local = rope_tables(config, spec, 64, "sliding_attention").to(device) if spec.local_rope else None
    if fused:
        model.use_gpu_kernels(backend)
    return model, spec


def decode_launches(family: str, num_layers: int, fused: bool) -> launch_count.LaunchCounter:
    """What one decode step of two sequences (contexts 5 and 9, block size 4) launches in bf16, after a
    warm-up step."""
    model, spec = random_model(family, num_layers, fused)
    bs, blocks = 4, 8
    kv = [(torch.randn(blocks, bs, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16),
           torch.randn(blocks, bs, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16)) for _ in range(num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.tensor([5, 20]),
                             query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                             seq_lens=torch.tensor([6, 10], dtype=torch.int32),
                             block_tables=torch.tensor([[1, 0, 0], [3, 4, 5]], dtype=torch.int32), block_size=bs,
                             query_lens_host=[1, 1], seq_lens_host=[6, 10])
    ids, positions = torch.tensor([7, 11]), torch.tensor([5, 9])
    with torch.inference_mode():
        model.layers[0].self_attn.backend.prepare(meta)
        model(ids, positions, kv, meta)  # warm-up, as before graph capture: one-time allocations stay out
        with launch_count.LaunchCounter() as counter:
            model(ids, positions, kv, meta)
    return counter


def per_layer(family: str, fused: bool) -> tuple[float, float, float]:
    """(kernels, triton, views) per decoder layer: the difference between a 3-layer and a 1-layer model's
    decode step, halved, so the embedding, final norm and RoPE table lookups drop out."""
    one, three = decode_launches(family, 1, fused), decode_launches(family, 3, fused)
    return ((three.kernels - one.kernels) / 2, (three.triton - one.triton) / 2, (three.views - one.views) / 2)


@interpreted
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "qwen3", "gemma2", "phi3", "mistral"])
def test_decode_step_launches_per_layer(family, monkeypatch):
    monkeypatch.setattr(triton_paged, "_auto_splits", h200_splits)
    kernels, triton, views = per_layer(family, fused=True)
    spec = random_model(family, 1, False)[1]
    plan = fused_forward.layer_launches(spec)
    assert (kernels, triton, views) == (plan.kernels, plan.triton, plan.views), \
        "the launch plan the simulated device prices is not what the fused layer launches"
    assert kernels <= BOUND.get(family, 8)
    if family in BOUND:  # the eager decoder is over the bound: this test fails on it
        eager, _, _ = per_layer(family, fused=False)
        assert eager > BOUND[family], f"eager decoder: {eager} kernels a layer"


# ---- the fused forward inside the engine, against Hugging Face -------------------------------------------------

NEW_TOKENS = 8  # the interpreter is slow


@interpreted
@pytest.mark.parametrize("family,graph_max", [("llama", 8), ("qwen2", None), ("qwen3", 8), ("gemma2", 2),
                                              ("gemma3_text", 8), ("phi3", 8), ("mistral", None)])
def test_fused_forward_greedy_matches_hf(tiny_model_factory, family, graph_max):
    """fp32 greedy token for token (near-ties excepted, as test_correctness_hf asserts them), chunked prefills
    interleaved with decodes; decodes replay emulated graphs of the fused forward where graph_max is set.
    Mistral's and Phi-3's windows (24) are crossed by the 30-token prompt; Gemma 2 soft-caps."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), device="cpu", attention_backend="triton", fused_forward=True, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=96, pipeline_depth=2)
    assert isinstance(llm.engine.runner.model.fused, fused_forward.FusedDecoder)
    if graph_max is not None:
        llm.engine.runner.capture_graphs(max_batch_size=graph_max, emulate=True)
    prompts = make_prompts(seed=11, lengths=(3, 9, 30))
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    llm.check_integrity()
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids, NEW_TOKENS)
    if graph_max is not None:  # every step replays: decodes, and prompt chunks beside them (mixed-step graphs)
        stats = llm.stats()
        assert stats["graph_steps"] == stats["steps"] and stats["mixed_graph_steps"] > 0


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interpreted),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2", "phi3"])
def test_fused_forward_equals_eager_logits(family, device, monkeypatch):
    """One decode step's final hidden states, fused against the eager layers on the same weights (fp32),
    within the fp32 summation error of norms and GEMMs reordered (relative 1e-5 of the row norm)."""
    if device == "cpu":
        monkeypatch.setattr(triton_paged, "_auto_splits", h200_splits)
    outs = []
    for fused in (False, True):
        model, spec = random_model(family, 2, fused, dtype=torch.float32, device=device)
        bs = 4
        g = torch.Generator().manual_seed(3)
        kv = [(torch.randn(8, bs, spec.num_kv_heads, spec.head_dim, generator=g).to(device),
               torch.randn(8, bs, spec.num_kv_heads, spec.head_dim, generator=g).to(device)) for _ in range(2)]
        i32 = dict(dtype=torch.int32, device=device)
        meta = AttentionMetadata(torch.tensor([5, 20], device=device), torch.tensor([0, 1, 2], **i32),
                                 torch.tensor([6, 10], **i32), torch.tensor([[1, 0, 0], [3, 4, 5]], **i32),
                                 bs, [1, 1], [6, 10])
        with torch.inference_mode():
            model.layers[0].self_attn.backend.prepare(meta)
            outs.append(model(torch.tensor([7, 11], device=device), torch.tensor([5, 9], device=device), kv, meta))
    eager, fused_out = outs
    err = (fused_out - eager).norm(dim=-1) / eager.norm(dim=-1)
    assert err.max().item() < 1e-5, f"{family}: relative error {err.max().item():.2e}"


@interpreted
def test_fused_forward_refuses_moe_by_name(tiny_model_factory):
    path, _ = tiny_model_factory("qwen2_moe")
    with pytest.raises(ValueError, match="fused_forward=True cannot run here: .*qwen2_moe is a mixture-of-experts"):
        LLM(str(path), device="cpu", attention_backend="triton", fused_forward=True, num_kv_blocks=16)


@interpreted
def test_fused_forward_needs_the_triton_backend(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="needs the 'triton' attention backend, not 'torch'"):
        LLM(str(path), device="cpu", attention_backend="torch", fused_forward=True, num_kv_blocks=16)


@interpreted
def test_cpu_path_never_fuses(tiny_model_factory):
    """auto (None) is off on CPU even with the Triton backend interpreted: the CPU keeps its own kernels."""
    path, _ = tiny_model_factory("llama")
    assert LLM(str(path), device="cpu", num_kv_blocks=16).engine.runner.model.fused is None
    spec = random_model("llama", 1, False)[1]
    assert fused_forward.wanted(None, spec, torch.device("cpu"), triton_paged.TritonPagedAttention()) is False
    with pytest.raises(ValueError, match="fused_forward must be a boolean or None"):
        LLM(str(path), device="cpu", fused_forward="yes")


def test_simulated_device_prices_the_fused_plan():
    """engine/sim's cost model takes a layer's launches from the fused forward's plan (the one the launch test
    counts), not from the eager constants; sim_kernels_per_layer still overrides it."""
    from engine.sim.cost_model import FIXED_KERNELS, LAYER_KERNELS, ModelCost

    spec = random_model("qwen2", 2, False)[1]
    plan = fused_forward.layer_launches(spec)
    cost = ModelCost.from_spec(spec, 2)
    assert (cost.layer_kernels, cost.layer_triton, cost.layer_views) == (plan.aten, plan.triton, plan.views)
    assert cost.kernels_per_forward == plan.kernels * spec.num_layers + FIXED_KERNELS
    assert cost.kernels_per_forward < (LAYER_KERNELS + 2) * spec.num_layers
    assert ModelCost.from_spec(spec, 2, kernels_per_layer=40).kernels_per_forward == \
        40 * spec.num_layers + FIXED_KERNELS


# ---- on a GPU (skipped without CUDA; scripts/gpu_check.sh runs them and prints the counts) ---------------------

def cuda_decode_kernels(family: str, num_layers: int) -> int:
    """CUDA kernels torch.profiler sees in one fused bf16 decode step (after a warm-up step)."""
    from torch.profiler import ProfilerActivity, profile

    model, spec = random_model(family, num_layers, True, device="cuda")
    kv = [(torch.randn(8, 4, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda"),
           torch.randn(8, 4, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda"))
          for _ in range(num_layers)]
    meta = AttentionMetadata(torch.tensor([5, 20], device="cuda"),
                             torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"),
                             torch.tensor([6, 10], dtype=torch.int32, device="cuda"),
                             torch.tensor([[1, 0, 0], [3, 4, 5]], dtype=torch.int32, device="cuda"), 4, [1, 1], [6, 10])
    ids, positions = torch.tensor([7, 11], device="cuda"), torch.tensor([5, 9], device="cuda")
    with torch.inference_mode():
        model(ids, positions, kv, meta)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, positions, kv, meta)
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "qwen3"])
def test_cuda_decode_kernels_per_layer_from_the_profiler(family):
    per_layer = (cuda_decode_kernels(family, 3) - cuda_decode_kernels(family, 1)) / 2
    print(f"\n{family}: {per_layer} CUDA kernels per layer in a fused bf16 decode step (torch.profiler)")
    assert per_layer <= BOUND.get(family, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3_text", "phi3"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fused_forward_on_cuda_greedy_matches_hf(tiny_model_factory, family, graphs):
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), device="cuda", dtype="float32", fused_forward=True, attention_backend="triton",
              cuda_graphs=graphs, block_size=4, max_num_batched_tokens=16, max_num_seqs=16, num_kv_blocks=256)
    prompts = make_prompts(seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids, 16)
    assert (llm.stats()["mixed_graph_steps"] > 0) == graphs  # prompt chunks replayed from graphs too
