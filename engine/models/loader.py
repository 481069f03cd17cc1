"""Build a DecoderLM from an HF checkpoint directory: config.json + safetensors (single or sharded).

No hub access: the directory must hold everything. HF parameter names are mapped onto the fused
qkv_proj / gate_up_proj layout here (Phi-3 checkpoints already hold them fused, in the same order), and MoE
experts onto their stacked [E, ...] parameters (engine/models/moe.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.cpu import kernels as cpu_native
from engine.cpu import linear as cpu_linear
from engine.models import fp8_loader, fused_forward, int4_loader, moe, tp as tensor_parallel
from engine.models.decoder import DecoderLM, ModelSpec, RotaryEmbedding
from engine.models.gguf_loader import build_gguf_model
from engine.models.quantized_checkpoint import checkpoint_scheme
from engine.models.tp import WHOLE  # a fused checkpoint tensor's shard index (Phi-3's qkv_proj)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3") + moe.MOE_FAMILIES
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a sliding_window only counts with use_sliding_window
_GEMMA = ("gemma2", "gemma3_text")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_hf_config(model_dir: str):
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read config.json in {model_dir!r}: {exc}") from exc


def model_spec(config) -> ModelSpec:
    family = config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; valid: {', '.join(SUPPORTED_FAMILIES)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{family} with use_bidirectional_attention is an encoder, not a causal LM; "
                         "Tandem serves causal decoders only")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    window = getattr(config, "sliding_window", None)
    if family in _QWEN and not getattr(config, "use_sliding_window", False):
        window = None
    gemma = family in _GEMMA
    hidden_act = (getattr(config, "hidden_activation", None) if gemma else None) \
        or getattr(config, "hidden_act", None) or "silu"
    return ModelSpec(
        family=family, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=attention_bias or family == "qwen2" or bool(getattr(config, "qkv_bias", False)),
        o_bias=attention_bias and family != "qwen2", mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window, max_position_embeddings=config.max_position_embeddings,
        hidden_act=hidden_act,
        layer_types=_layer_types(config, window), norm_unit_offset=gemma, sandwich_norms=gemma,
        embed_scale=config.hidden_size ** 0.5 if gemma else None,
        attn_scale=config.query_pre_attn_scalar ** -0.5 if gemma else None,
        # HF's Gemma 3 attention never applies attn_logit_softcapping (its configs leave it null); Gemma 2's does.
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if family == "gemma2" else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        rotary_dim=_rotary_dim(config, head_dim), local_rope=family == "gemma3_text",
        moe=moe.moe_spec(config, family, hidden_act),
    )


def _layer_types(config, window: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds from config.layer_types (transformers 5.x: Gemma's alternation, Qwen2's
    max_window_layers); configs without them slide every layer when they have a window."""
    types = getattr(config, "layer_types", None)
    if types is None or window is None:
        kind = "sliding_attention" if window is not None else "full_attention"
        return (kind,) * config.num_hidden_layers
    return tuple(types)


def _rope_params(config, layer_type: str | None = None) -> dict:
    """The rope_parameters dict, or for a per-layer-type one (Gemma 3: {"full_attention": {...},
    "sliding_attention": {...}}) the entry for `layer_type`."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" not in params and "rope_theta" not in params and params:
        return params[layer_type or "full_attention"]
    return params


def _rotary_dim(config, head_dim: int) -> int:
    """Phi-3/4's partial_rotary_factor (in rope_parameters in transformers 5.x, top-level in config.json)."""
    factor = _rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(head_dim * (factor or 1.0))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dims of head_dim {head_dim}; "
                         "need an even number in (0, head_dim]")
    return dim


def rope_tables(config, spec: ModelSpec, max_positions: int,
                layer_type: str | None = None) -> RotaryEmbedding:
    """RoPE with the checkpoint's theta and scaling (transformers' own init functions for scaled types);
    `layer_type` picks the entry of a per-layer-type rope_parameters (Gemma 3's local layers).

    LongRoPE (Phi-3/4) switches factors by sequence length in HF (short up to
    original_max_position_embeddings, long beyond, recomputing the cache when a sequence crosses). A paged
    cache cannot re-rotate stored keys, so here the choice is fixed per engine, as vLLM does: the long factor
    when `max_positions` (max_model_len) exceeds original_max_position_embeddings, else the short one.
    Sequences that stay within the original length then differ from HF's when max_model_len is larger."""
    params = _rope_params(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; valid: {', '.join(_STATIC_ROPE_TYPES)}")
    rotary_dim = spec.rotary_dim or spec.head_dim
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        scaling = 1.0
    else:
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "longrope":
            kwargs["seq_len"] = max_positions
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return RotaryEmbedding(inv_freq, scaling, max_positions)


def build_model(model_dir: str, config, spec: ModelSpec, max_positions: int, backend,
                dtype: torch.dtype, device: torch.device, layers: tuple[int, int] | None = None,
                cpu_onednn: bool = True, tp: tensor_parallel.TPShard | None = None,
                fused: bool | None = None, gguf_file: str | None = None) -> DecoderLM:
    """The whole model, or with `layers=(start, end)` one pipeline stage holding only its own weights.
    On CPU its linears are packed (engine/cpu/linear.py: Tandem's fp32 GEMM or oneDNN) unless
    `cpu_onednn` is off, and it runs the fused elementwise kernels (engine/cpu/fused.cpp) unless
    TANDEM_CPU_KERNELS=0.
    With `tp`, one tensor-parallel rank's shard (engine/models/tp.py): `spec` must then be its local_spec.
    `fused` (EngineConfig.fused_forward): the fused forward of engine/models/fused_forward.py; None = on CUDA
    with the Triton attention backend for the families it runs; True on CPU only under Triton's interpreter
    (tests), and then the linears stay unpacked and the CPU's own kernels off.
    With `gguf_file`, the weights come from it, quantized where the CPU kernels run the type
    (engine/models/gguf_loader.py; `model_dir` then holds only config and tokenizer; a stage reads only its
    own tensors). A GPTQ / AWQ int4
    checkpoint's linears run the Triton int4 GEMM on CUDA (and with `fused` True, under the interpreter), else
    the CPU's Q4_1 GEMM (engine/models/int4_loader.py). Quantized weights shard with `tp` as float ones do, on
    block boundaries (engine/models/tp.py)."""
    moe.check_device(spec.moe, device)
    rotary = rope_tables(config, spec, max_positions, "full_attention" if spec.local_rope else None)
    local = rope_tables(config, spec, max_positions, "sliding_attention") if spec.local_rope else None
    if gguf_file is not None:
        return build_gguf_model(gguf_file, spec, rotary, local, backend, dtype, device, layers, tp)
    with torch.device("meta"):  # no random init: every parameter is overwritten by load_weights
        model = DecoderLM(spec, None, backend, layers)
    scheme = checkpoint_scheme(model_dir)
    if scheme is not None:  # quantized linears placed (with `tp`, this rank's shards) before the float parameters
        if isinstance(scheme, int4_loader.Int4Scheme):  # GPTQ / AWQ int4
            gpu = device.type == "cuda" or fused is True  # the Triton int4 GEMM wherever the GPU kernels run
            int4_loader.place_int4_linears(model, model_dir, scheme, dtype, device, gpu, tp)
            fused = fused if gpu else False  # Q4_1 QuantLinears: the CPU's path
        else:  # FP8: Fp8Linears
            fp8_loader.place_fp8_linears(model, model_dir, scheme, dtype, device, tp)
            fused = False  # the fused forward reads plain float weights
    model = model.to_empty(device=device).to(dtype)
    model.rotary = rotary.to(device)  # fp32 tables, kept out of the dtype cast above
    model.reset_kv_scales(device)  # fp32 too
    model.rotary_local = local.to(device) if local is not None else None
    load_weights(model, model_dir, tp)
    if tp is not None:
        tensor_parallel.parallelize(model, tp)
    model = model.eval().requires_grad_(False)
    if fused_forward.wanted(fused, spec, device, backend):
        model.use_gpu_kernels(backend)
        return model
    if device.type == "cpu" and cpu_onednn and cpu_linear.available(dtype):
        model.pack_for_cpu()
    if device.type == "cpu":
        model.use_cpu_kernels(cpu_native.load(), dtype)
    return model


def _safetensors_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir!r}")
    return files


def load_weights(model: DecoderLM, model_dir: str, tp: tensor_parallel.TPShard | None = None) -> None:
    """Copy every checkpoint tensor the model holds into its (possibly fused) parameter; fail naming what
    is missing. A pipeline stage reads only its own tensors (safetensors loads lazily, by name); a
    tensor-parallel rank only its slice of each (tensor_parallel.read_shard)."""
    params = dict(model.named_parameters())
    filled: set[tuple[str, int]] = set()
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _map_name(name, model.spec, model.layer_range[0])
                if target is None or target[0] not in params:
                    continue
                pname, shard = target
                tensor = f.get_tensor(name) if tp is None else tensor_parallel.read_shard(f, name, pname, shard, tp)
                _copy_into(pname, params[pname], tensor, shard, model.spec)
                filled.update((pname, s) for s in (_shards_of(pname, model.spec) if shard == WHOLE else (shard,)))
    expected = {(n, s) for n, p in params.items() for s in _shards_of(n, model.spec)}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for {[m[0] for m in missing[:8]]}")


def _map_name(name: str, spec: ModelSpec, first_layer: int = 0) -> tuple[str, int] | None:
    """HF tensor name -> (our parameter name, shard index within a fused parameter, or WHOLE); layer
    indices are made local to a stage starting at `first_layer` (names outside the stage are simply not
    parameters)."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0
    if name == "model.norm.weight":
        return "norm.weight", 0
    if name == "lm_head.weight":
        return None if spec.tie_word_embeddings else ("lm_head.weight", 0)
    m = _LAYER_RE.match(name)
    if not m or "rotary_emb" in name:
        return None
    layer, rest = int(m.group(1)) - first_layer, m.group(2)
    expert = moe.checkpoint_target(rest, spec.moe) if spec.moe is not None else None
    if expert is not None:
        return f"layers.{layer}.{expert[0]}", expert[1]
    for proj, fused, shard in (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1),
                               ("v_proj", "qkv_proj", 2), ("gate_proj", "gate_up_proj", 0),
                               ("up_proj", "gate_up_proj", 1)):
        if f".{proj}." in f".{rest}":
            return f"layers.{layer}.{rest.replace(proj, fused)}", shard
    pname = f"layers.{layer}.{rest}"
    return pname, WHOLE if len(_shards_of(pname, spec)) > 1 else 0


def _shards_of(pname: str, spec: ModelSpec) -> range:
    if moe.is_stacked(pname):
        return moe.stacked_slots(pname, spec.moe)
    if "qkv_proj" in pname:
        return range(3)
    if "gate_up_proj" in pname:
        return range(2)
    return range(1)


def _copy_into(pname: str, param: torch.Tensor, tensor: torch.Tensor, shard: int, spec: ModelSpec) -> None:
    if shard == WHOLE:
        dst = param
    elif moe.is_stacked(pname):
        dst = moe.stacked_slot(param, pname, shard)
    elif "qkv_proj" in pname:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        dst = param.narrow(0, (0, q, q + kv)[shard], (q, kv, kv)[shard])
    elif "gate_up_proj" in pname:
        size = param.shape[0] // 2  # this MLP's own width (a shared expert's differs from intermediate_size)
        dst = param.narrow(0, shard * size, size)
    else:
        dst = param
    if dst.shape != tensor.shape:
        raise ValueError(f"weight shape mismatch for {pname}: checkpoint {tuple(tensor.shape)} "
                         f"vs model {tuple(dst.shape)}")
    dst.data.copy_(tensor)
