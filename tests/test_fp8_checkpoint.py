"""FP8 checkpoints served as they are (engine/models/fp8_loader.py, engine/models/fp8_linear.py).

The checkpoints are written here, from the formats' definitions: every decoder linear of a tiny random model
rounded to e4m3 with per-channel or per-tensor scales (s = max |w| / 448), saved with the quantization_config
compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC) or transformers' fbgemm_fp8 writes. The oracles:
- one linear: an fp64 matmul of the dequantized weight (q * s) and of the activations quantized by this file's
  reference (e4m3_round_trip, itself checked against compressed-tensors' own fake quantization), within the
  fp32 summation bound;
- weight-only models: transformers loading the compressed-tensors checkpoint (compressed-tensors dequantizes
  it) gives the same greedy tokens, token for token (near-ties aside, as in test_correctness_hf);
- W8A8 models: Hugging Face on the dequantized weights with every quantized linear's input rounded by the
  reference quantizer (a forward pre-hook): greedy tokens again, and for dynamic scales every teacher-forced
  logprob within 1e-3. No bound holds a priori: an activation within an fp32 rounding of an e4m3 midpoint
  rounds either way, and the two sides sum in different orders. With dynamic per-token scales that needs a
  coincidence these seeds do not hit; with static scales (or fbgemm's activation_scale_ub clamping) a
  linear's outputs are sums of e4m3 products times fixed scales, a lattice whose points land on midpoints of
  the next linear's grid, and such ties do flip (seen: 10.49993 vs 10.5 times the scale), so there the
  greedy tokens are compared (near-ties aside) and the arithmetic is the one-linear test's.
Also: the real SmolLM2-135M rounded to FP8 (weight-only) against transformers + compressed-tensors, the bytes
held against the file's, refusals by name, LoRA over FP8 linears against PEFT, a pipeline stage's placement, and
the simulated device's weight bytes.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, SamplingParams
from engine.cpu.quant import quantized_bytes
from engine.models.fp8_linear import E4M3, Fp8Linear, fp8_values
from engine.models.fp8_loader import fp8_scheme
from engine.models.gguf_loader import weight_bytes
from engine.models.quantized_checkpoint import checkpoint_scheme
from test_correctness_hf import MAX_NEW, assert_matches_hf, hf_greedy, make_prompts

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# static input scales (compressed-tensors' FP8 scheme): q, k and v differ, so a fused qkv keeps three parts
STATIC = {"q_proj": 0.011, "k_proj": 0.009, "v_proj": 0.013, "o_proj": 0.01, "gate_proj": 0.012,
          "up_proj": 0.012, "down_proj": 0.05}
U = 2.0**-24  # fp32 unit roundoff


# ---- the formats, from their definitions ------------------------------------------------------------------

def quantize_e4m3(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scale [N, 1] per channel or [1] per tensor): s = max |w| / 448."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    s = amax / 448
    return (w / s).clamp(-448, 448).to(E4M3), s


def e4m3_round_trip(x: torch.Tensor, static: float | None = None, ub: float | None = None) -> torch.Tensor:
    """x quantized to e4m3 and back, per token (last dim) or with a static scale (compressed-tensors' definition:
    s = max |x| / 448, q = e4m3(clamp(x / s, +-448)); fbgemm clamps max |x| to activation_scale_ub first)."""
    x32 = x.float()
    if static is None:
        amax = x32.abs().amax(dim=-1, keepdim=True)
        s = (amax if ub is None else amax.clamp(max=ub)) / 448
    else:
        s = torch.tensor(static)
    return (x32 / s).clamp(-448, 448).to(E4M3).float() * s


def ct_qconfig(strategy: str, acts: str | None) -> dict:
    """compressed-tensors' quantization_config as llm-compressor saves it (QuantizationConfig.model_dump)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
               "dynamic": False}
    inputs = None if acts is None else {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                                        "strategy": acts, "dynamic": acts == "token"}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": None}},
            "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"]}


def fbgemm_qconfig(ub: float) -> dict:
    """transformers' FbgemmFp8Config.to_dict()."""
    return {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub, "modules_to_not_convert": ["lm_head"]}


def write_fp8(src, dst, qc: dict, strategy: str = "channel", static: bool = False, biases: bool = False) -> dict:
    """dst := src's checkpoint with every decoder linear in e4m3 (`static`: with STATIC input scales; `biases`:
    random q/k/v biases, so they count); returns {tensor name: what Hugging Face should hold} for what changed."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(7)
    out, refs = {}, {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        module, leaf = name.rsplit(".", 1)[0], name.rsplit(".", 2)[-2]
        if name.endswith(".bias") and biases:
            value = refs[name] = torch.randn(value.shape, generator=gen) * 0.3
        if not (name.endswith(".weight") and leaf in LINEARS):
            out[name] = value
            continue
        q, s = quantize_e4m3(value.float(), strategy)
        out.update({name: q, f"{module}.weight_scale": s})
        if static:
            out[f"{module}.input_scale"] = torch.tensor([STATIC[leaf]])
        refs[name] = q.float() * s
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return refs


def hf_on(hf_model, refs: dict[str, torch.Tensor], acts: str | None = None, ub: float | None = None):
    """A copy of the HF model holding `refs`; with `acts` ("token" / "tensor"), every quantized linear's input
    rounded by e4m3_round_trip first."""
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in refs.items():
            params[name].copy_(w)
    if acts is not None:
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in LINEARS:
                static = STATIC[leaf] if acts == "tensor" else None
                module.register_forward_pre_hook(lambda m, args, s=static: (e4m3_round_trip(args[0], s, ub),))
    return model


def fp8_llm(path, **kw) -> LLM:
    return LLM(str(path), block_size=4, max_num_batched_tokens=32, **kw)


def greedy(llm: LLM, prompts, **kw) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), **kw)
    return [o.token_ids for o in outs]


# ---- the reference and one linear ----------------------------------------------------------------------------

def test_the_reference_quantizer_is_compressed_tensors_own():
    """e4m3_round_trip is what compressed-tensors' forward does to a linear's input (dynamic per token on a
    [batch, tokens, hidden] input; static per tensor), bit for bit."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)) * 3
    token = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    scale, zero = compute_dynamic_scales_and_zp(x, token, module=torch.nn.Module())
    assert torch.equal(fake_quantize(x, scale, zero, token), e4m3_round_trip(x))
    tensor = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    assert torch.equal(fake_quantize(x, torch.tensor([0.01]), None, tensor), e4m3_round_trip(x, 0.01))


def test_fp8_values_are_every_e4m3_code_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3)
    want = codes.double()
    finite = ~want.isnan()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal((fp8_values(codes, dtype).double() * 256)[finite], want[finite]), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("acts,ub", [(None, None), ("token", None), ("token", 1.5), ("tensor", None)])
def test_linear_is_the_dequantized_weights_within_the_summation_bound(acts, ub, dtype):
    """A fused-like linear of three parts (q, k, v sizes; static scales differ per part) against fp64 on the
    dequantized weights and the reference-quantized activations (fbgemm's upper bound clamping most rows with
    `ub`): fp32 sums of K products, the scales applied after (3 more roundings), for bf16 the output's rounding."""
    gen = torch.Generator().manual_seed(3)
    sizes, k = [48, 16, 32], 96
    n = sum(sizes)
    q, s = quantize_e4m3(torch.randn(n, k, generator=gen) * 0.1, "channel")
    bias = (torch.randn(n, generator=gen) * 0.5).to(dtype)
    scales = [0.01, 0.02, 0.01] if acts == "tensor" else None
    lin = Fp8Linear(q, s.view(n), bias, acts, dtype, scales, sizes, ub)
    assert len(lin.parts) == (3 if acts == "tensor" else 1)
    x = (torch.randn(5, k, generator=gen) * 2).to(dtype)
    w = q.double() * s.double()
    starts = [0, 48, 64, 96]
    a = [x.double() if acts is None else e4m3_round_trip(x, scales[i] if scales else None, ub).double()
         for i in range(3)]
    want = torch.cat([a[i] @ w[starts[i]:starts[i + 1]].t() for i in range(3)], dim=-1) + bias.double()
    mag = torch.cat([a[i].abs() @ w[starts[i]:starts[i + 1]].abs().t() for i in range(3)], dim=-1)
    gamma = (k + 3) * U / (1 - (k + 3) * U)
    bound = gamma * mag + 2 * U * bias.double().abs() + 1e-30
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (want.abs() + bound)  # the output rounded to bf16
    got = lin(x)
    assert got.dtype == dtype and got.shape == (5, n)
    assert ((got.double() - want).abs() <= bound).all()


# ---- the scheme -------------------------------------------------------------------------------------------------

def _ct(**changes) -> dict:
    qc = ct_qconfig("channel", "token")
    for path, value in changes.items():
        *where, field = path.split("__")
        d = qc
        for key in where:
            d = d[key]
        d[field] = value
    return qc


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method='fp8'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    (_ct(format="int-quantized"), "format='int-quantized'"),
    (_ct(format="nvfp4-pack-quantized"), "format='nvfp4-pack-quantized'"),
    (_ct(quantization_status="frozen"), "quantization_status='frozen'"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    (_ct(config_groups__group_0__weights__type="int"), r"weights\.type='int'"),
    (_ct(config_groups__group_0__weights__num_bits=4), r"weights\.num_bits=4"),
    (_ct(config_groups__group_0__weights__symmetric=False), r"weights\.symmetric=False"),
    (_ct(config_groups__group_0__weights__strategy="block"), r"weights\.strategy='block'"),
    (_ct(config_groups__group_0__weights__strategy="group"), r"weights\.strategy='group'"),
    (_ct(config_groups__group_0__input_activations__strategy="group"), "strategy='group' dynamic=True"),
    (_ct(config_groups__group_0__input_activations__dynamic=False), "strategy='token' dynamic=False"),
    (_ct(config_groups__group_0__output_activations={"num_bits": 8}), "output_activations"),
    (_ct(config_groups={"a": ct_qconfig("channel", "token")["config_groups"]["group_0"],
                        "b": ct_qconfig("tensor", None)["config_groups"]["group_0"]}), "different schemes"),
    (fbgemm_qconfig(-1.0), "activation_scale_ub=-1.0"),
])
def test_unsupported_schemes_are_refused_by_name(qc, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(ValueError, match=match):
        checkpoint_scheme(tmp_path)


def test_the_configs_written_here_are_what_compressed_tensors_reads():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    for strategy, acts in (("channel", None), ("channel", "token"), ("tensor", "tensor")):
        qc = QuantizationConfig.model_validate(ct_qconfig(strategy, acts))
        group = qc.config_groups["group_0"]
        assert group.weights.strategy == strategy and group.weights.type == "float"
        assert (group.input_activations and group.input_activations.strategy) == acts
        assert fp8_scheme(ct_qconfig(strategy, acts)).activations == acts


# ---- whole models --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,strategy", [("llama", "channel"), ("qwen2", "tensor")])
def test_weight_only_greedy_equals_transformers_on_the_checkpoint(tiny_model_factory, tmp_path, family, strategy):
    """W8A16: transformers + compressed-tensors load the checkpoint (dequantized) and give the same greedy tokens.
    Qwen2: random q/k/v biases and a tied head; per-tensor scales become per-row ones."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path, _ = tiny_model_factory(family)
    qdir = tmp_path / "fp8"
    write_fp8(path, qdir, ct_qconfig(strategy, None), strategy, biases=family == "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(str(qdir), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    llm = fp8_llm(qdir)
    fp8 = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * hf.config.num_hidden_layers and all(m.activations is None for m in fp8)
    prompts = make_prompts(seed=2)
    for prompt, ours in zip(prompts, greedy(llm, prompts)):
        assert_matches_hf(hf.eval(), prompt, ours)
    llm.shutdown()


@pytest.mark.parametrize("family,qc,strategy,acts,ub", [
    ("llama", ct_qconfig("channel", "token"), "channel", "token", None),  # FP8_DYNAMIC
    ("qwen2", ct_qconfig("tensor", "tensor"), "tensor", "tensor", None),  # FP8 (static): q, k, v scales differ
    ("llama", fbgemm_qconfig(1200.0), "channel", "token", 1200.0),
])
def test_w8a8_greedy_equals_hf_with_its_activations_quantized(tiny_model_factory, tmp_path, family, qc, strategy,
                                                              acts, ub):
    path, hf = tiny_model_factory(family)
    qdir = tmp_path / "fp8"
    refs = write_fp8(path, qdir, qc, strategy, static=acts == "tensor", biases=family == "qwen2")
    reference = hf_on(hf, refs, acts, ub)
    llm = fp8_llm(qdir)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.activations == acts and len(qkv.parts) == (3 if acts == "tensor" else 1)
    prompts = make_prompts(seed=2)
    outs = greedy(llm, prompts)
    for prompt, ours in zip(prompts, outs):
        assert_matches_hf(reference, prompt, ours)
    if acts == "token":  # static scales put activations on a lattice whose midpoints e4m3 ties hit (docstring)
        assert_logprobs_match(llm, reference, [p + hf_greedy(reference, p)[0] for p in prompts])
    unquantized = hf_on(hf, refs)
    plain = [hf_greedy(unquantized, p)[0] for p in prompts]
    assert plain != [o for o in outs], "quantizing the activations changed nothing: a weak check"
    llm.shutdown()


def assert_logprobs_match(llm: LLM, reference, seqs: list[list[int]], tol: float = 1e-3) -> None:
    """Teacher-forced: Tandem's logprob of every token of `seqs` (prompt_logprobs) within `tol` of the
    reference's. Without an e4m3 rounding that flips, the two differ by fp32 rounding alone (1e-5 relative a
    linear at these K, through two layers and the head: far under 1e-3); a flip would exceed it."""
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    for seq, out in zip(seqs, outs):
        with torch.no_grad():
            want = reference(torch.tensor([seq])).logits[0].log_softmax(-1)
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
        diff = (got - want[torch.arange(len(seq) - 1), seq[1:]]).abs()
        assert diff.max() < tol, f"position {int(diff.argmax()) + 1}: logprobs differ by {diff.max():.2e}"


def test_resident_weights_within_ten_percent_of_the_file(tiny_model_factory, tmp_path):
    """Built unpacked (so every float weight is a parameter): the FP8 linears hold their e4m3 bytes and fp32 row
    scales, as the file does, and the whole model about the file's size."""
    from engine.attention import get_backend
    from engine.models import model_spec
    from engine.models.loader import build_model, load_hf_config

    path, _ = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    write_fp8(path, qdir, ct_qconfig("channel", "token"))
    config = load_hf_config(str(qdir))
    spec = model_spec(config)
    model = build_model(str(qdir), config, spec, 64, get_backend("torch"), torch.float32, torch.device("cpu"),
                        cpu_onednn=False)
    tensors = load_file(str(qdir / "model.safetensors"))
    fp8_file = sum(t.numel() * t.element_size() for n, t in tensors.items()
                   if t.dtype == E4M3 or n.endswith(".weight_scale"))
    assert quantized_bytes(model) == fp8_file
    size = (qdir / "model.safetensors").stat().st_size
    assert 0.9 * size <= weight_bytes(model) <= 1.1 * size, (weight_bytes(model), size)


def test_engine_settings(tiny_model_factory, tmp_path):
    """FP8 runs where the engine does (cuda, sim, bf16, LoRA, tensor parallelism: its sharding is
    tests/test_tensor_parallel_quantized.py's)."""
    path, _ = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    write_fp8(path, qdir, ct_qconfig("channel", "token"))
    for kw in (dict(device="cuda", dtype="bfloat16"), dict(device="sim"), dict(enable_lora=True),
               dict(dtype="bfloat16"), dict(tensor_parallel_size=2)):
        EngineConfig(model=str(qdir), **kw)


@pytest.mark.parametrize("change,match", [
    ("head", "lm_head.weight"),  # an FP8 LM head: Tandem's heads are float
    ("e5m2", "F8_E5M2"),
    ("partial", "some of"),  # q in FP8, k and v not
    ("scale", "weight_scale of shape"),
])
def test_checkpoints_it_cannot_run_are_refused_at_load(tiny_model_factory, tmp_path, change, match):
    path, _ = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    write_fp8(path, qdir, ct_qconfig("channel", None))
    tensors = load_file(str(qdir / "model.safetensors"))
    if change == "head":
        tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = quantize_e4m3(tensors["lm_head.weight"],
                                                                                  "channel")
    elif change == "e5m2":
        tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].float().to(
            torch.float8_e5m2)
    elif change == "partial":
        for p in ("k_proj", "v_proj"):
            tensors[f"model.layers.1.self_attn.{p}.weight"] = tensors[f"model.layers.1.self_attn.{p}.weight"].float()
    else:
        tensors["model.layers.0.self_attn.o_proj.weight_scale"] = torch.ones(3, 1)
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        LLM(str(qdir))


def test_a_pipeline_stage_places_only_its_own_layers(tiny_model_factory, tmp_path):
    from engine.attention import get_backend
    from engine.models import model_spec
    from engine.models.loader import build_model, load_hf_config

    path, _ = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    write_fp8(path, qdir, ct_qconfig("channel", "token"))
    config = load_hf_config(str(qdir))
    for layers in ((0, 1), (1, 2)):
        stage = build_model(str(qdir), config, model_spec(config), 64, get_backend("torch"), torch.float32,
                            torch.device("cpu"), layers=layers)
        assert sum(isinstance(m, Fp8Linear) for m in stage.modules()) == 4


def test_lora_over_fp8_linears_matches_peft(tiny_model_factory, tmp_path):
    """A PEFT adapter on every linear of the weight-only FP8 model: the oracle is PEFT over Hugging Face holding
    the dequantized weights."""
    from test_lora import build_adapter

    path, hf = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    refs = write_fp8(path, qdir, ct_qconfig("channel", None))
    peft = build_adapter(hf_on(hf, refs), tmp_path / "adapter", seed=1, r=8, lora_alpha=16,
                         target_modules=list(LINEARS))
    llm = fp8_llm(qdir, lora_modules={"a": str(tmp_path / "adapter")}, max_lora_rank=8)
    prompts = make_prompts(seed=4, lengths=(5, 21, 40))
    for prompt, ours in zip(prompts, greedy(llm, prompts, lora_request="a")):
        assert_matches_hf(peft, prompt, ours)
    assert hf_greedy(peft, prompts[0])[0] != hf_greedy(hf_on(hf, refs), prompts[0])[0], "the adapter changes nothing"
    llm.shutdown()


def sim_cost_and_kv_blocks(model: str):
    """(the cost model's ModelCost, the KV blocks planned) for `model` on the simulated H100."""
    llm = LLM(model, device="sim", sim_gpu="h100", max_num_seqs=256, max_model_len=131072)
    try:
        r = llm.engine.core.runner
        return r.cost.model, r.num_kv_blocks
    finally:
        llm.shutdown()


def test_the_simulated_device_holds_a_byte_a_weight(tmp_path):
    """Llama-3.1-8B's config with an FP8 quantization_config on the simulated H100: its decoder linears are
    priced at 1 byte a weight plus fp32 row scales (the head and embedding stay bf16), and the KV cache gets
    the memory freed."""
    from engine.sim import SIM_MODELS

    runner = sim_cost_and_kv_blocks

    fp8 = tmp_path / "llama-fp8"
    shutil.copytree(SIM_MODELS / "llama-3.1-8b", fp8)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": ct_qconfig("channel", "token")}))
    (bf16, bf16_blocks), (ours, fp8_blocks) = runner(str(SIM_MODELS / "llama-3.1-8b")), runner(str(fp8))
    h, i, q, kv = 4096, 14336, 4096, 1024
    linears = ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i))
    assert ours.layer_weight_bytes == sum(n * k + 4 * n for n, k in linears)
    assert bf16.layer_weight_bytes == 2 * sum(n * k for n, k in linears)
    assert ours.head_weight_bytes == bf16.head_weight_bytes == 128256 * h * 2
    freed, per_block = 32 * (bf16.layer_weight_bytes - ours.layer_weight_bytes), 16 * ours.kv_bytes_per_token
    assert abs((fp8_blocks - bf16_blocks) * per_block - freed) <= per_block  # every freed byte to the KV cache


def test_real_smollm2_fp8_greedy_equals_transformers(tmp_path):
    """SmolLM2-135M-Instruct rounded here to FP8 per channel, weight-only: Tandem's greedy tokens equal
    transformers + compressed-tensors' on the same checkpoint for 8 chat prompts (or first differ at a
    near-tie), and the model holds about the file's size."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from engine.models import from_gguf

    src = from_gguf.smollm2_dir()
    qdir = tmp_path / "smollm2-fp8"
    write_fp8(src, qdir, ct_qconfig("channel", None))
    hf = AutoModelForCausalLM.from_pretrained(str(qdir), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    tok = AutoTokenizer.from_pretrained(str(src))
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is.",
                 "List three prime numbers.", "Who wrote Romeo and Juliet?", "What is 12 times 7?",
                 "How do plants make food?", "Why is the sky blue?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in questions]
    # Sized for these prompts: the default sizing profiles 256 sequences and zeroes a KV pool of half the free RAM.
    llm = LLM(str(qdir), max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=128)
    size = (qdir / "model.safetensors").stat().st_size
    assert 0.9 * size <= weight_bytes(llm.engine.runner.model) <= 1.1 * size
    for prompt, ours in zip(prompts, greedy(llm, prompts)):
        assert_matches_hf(hf.eval(), list(prompt), ours)
    llm.shutdown()
