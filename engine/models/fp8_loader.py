"""FP8 checkpoints served as they are: e4m3 weights with per-channel or per-tensor scales, run by
engine/models/fp8_linear.py on CPU and CUDA.

config.json's `quantization_config`, as transformers reads it:
- quant_method "compressed-tensors" (llm-compressor's FP8 / FP8_DYNAMIC schemes), format "float-quantized" (or
  "naive-quantized"): every config group's `weights` {num_bits: 8, type: "float", symmetric: true, strategy:
  "channel" | "tensor"} and `input_activations` null (weight-only), {strategy: "token", dynamic: true} or
  {strategy: "tensor", dynamic: false} (then each linear holds an `input_scale`). Per linear: `weight` e4m3
  [N, K], `weight_scale` [N, 1] (channel) or [1] (tensor), in the checkpoint's float dtype.
- quant_method "fbgemm_fp8": `weight` e4m3 [N, K], `weight_scale` [N, 1]; activations dynamic per token, their
  max clamped to `activation_scale_ub`.
Which linears are FP8 is read from the tensors' dtypes (what `ignore` / `modules_to_not_convert` and
`targets` made of the model), so those lists are not matched again here; a linear kept in float loads as any
other. Refused, naming the field: other bit widths and types (int8 W8A8, FP4), group and block scales
(quant_method "fp8", DeepSeek-style 128x128 blocks), asymmetric or dynamic weights, config groups that
disagree, output activations, a kv_cache_scheme, transforms, sparsity; at load, an FP8 LM head, embedding or
mixture-of-experts model, and e5m2 tensors.

Tensor parallelism shards the e4m3 weights as float ones: column-parallel rows with their per-row scales (a
per-tensor scale is already one per row) and biases; row-parallel (o, down) along K at any column, the row
scales, bias and static input scales whole. Dynamic per-token activations are then quantized per rank, over the
rank's K slice of each token (as vLLM's row-parallel layers do): TP=N rounds them differently from one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.decoder import DecoderLM
from engine.models.fp8_linear import Fp8Linear
from engine.models.quantized_checkpoint import Checkpoint, in_stage
from engine.models.tp import WHOLE, TPShard, take_shard

FP8_METHODS = ("compressed-tensors", "fbgemm_fp8")
E4M3_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
_CT_FORMATS = ("float-quantized", "naive-quantized")
# (decoder submodule, its fused linear, the checkpoint's linears stacked in it; Phi-3 holds the fused one)
_LINEARS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn", "o_proj", ("o_proj",)),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj")), ("mlp", "down_proj", ("down_proj",)))


@dataclass(frozen=True)
class Fp8Scheme:
    """A checkpoint's FP8 quantization, validated."""

    method: str  # "compressed-tensors" | "fbgemm_fp8"
    weights: str  # "channel" | "tensor": one scale per output row, or one per linear
    activations: str | None  # None (weight-only) | "token" (dynamic) | "tensor" (static input_scale)
    scale_ub: float | None = None  # fbgemm's activation_scale_ub: dynamic scales' max |x| is clamped to it

    def linear_bytes(self, n: int, k: int) -> int:
        """Bytes an [n, k] linear holds: the e4m3 weight and its fp32 per-row scales."""
        return n * k + 4 * n


def fp8_scheme(qc: dict) -> Fp8Scheme:
    """The scheme of a quantization_config; ValueError naming the field Tandem does not run."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub", 1200.0)  # transformers' FbgemmFp8Config default
        if isinstance(ub, bool) or not isinstance(ub, (int, float)) or ub <= 0:
            raise ValueError(f"fbgemm_fp8 activation_scale_ub={ub!r} is not valid: a number > 0")
        return Fp8Scheme(method, "channel", "token", float(ub))
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config quant_method={qc.get('quant_method')!r} is not an FP8 method "
                         f"Tandem runs; valid: {', '.join(FP8_METHODS)}")
    _check_ct_fields(qc)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors config_groups is missing or empty")
    schemes = {name: _ct_group(name, group) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        raise ValueError(f"compressed-tensors config_groups with different schemes are not supported: {schemes}")
    weights, activations = next(iter(schemes.values()))
    return Fp8Scheme(method, weights, activations)


def _check_ct_fields(qc: dict) -> None:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise ValueError(f"compressed-tensors format={fmt!r} is not supported; valid: {', '.join(_CT_FORMATS)} "
                         "(FP8 weights)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors quantization_status={status!r} is not supported: 'compressed' "
                         "(weights stored in FP8)")
    for field in ("kv_cache_scheme", "transform_config"):
        if qc.get(field):
            raise ValueError(f"compressed-tensors {field}={qc[field]!r} is not supported")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity_config format={sparsity.get('format')!r} is not supported")


def _ct_group(name: str, group: dict) -> tuple[str, str | None]:
    """(weight strategy, activation kind) of one config group; ValueError naming the field that is not FP8
    per-channel / per-tensor."""
    where = f"compressed-tensors config_groups.{name}"
    if group.get("output_activations"):
        raise ValueError(f"{where}.output_activations is not supported")
    w = group.get("weights") or {}
    _check_e4m3(f"{where}.weights", w)
    if w.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"{where}.weights.strategy={w.get('strategy')!r} is not supported; valid: channel, tensor "
                         "(group and block scales are not run)")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic={w['dynamic']!r} is not supported: stored weight scales only")
    a = group.get("input_activations")
    if a is None:
        return w["strategy"], None
    _check_e4m3(f"{where}.input_activations", a)
    kind = (a.get("strategy"), a.get("dynamic"))
    if kind not in (("token", True), ("tensor", False)):
        raise ValueError(f"{where}.input_activations strategy={kind[0]!r} dynamic={kind[1]!r} is not supported; "
                         "valid: strategy 'token' dynamic true, or strategy 'tensor' dynamic false")
    return w["strategy"], kind[0]


def _check_e4m3(where: str, args: dict) -> None:
    for field, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if args.get(field, True if field == "symmetric" else None) != want:
            raise ValueError(f"{where}.{field}={args.get(field)!r} is not supported: FP8 e4m3 ({field} {want!r})")


def place_fp8_linears(model: DecoderLM, model_dir: str, scheme: Fp8Scheme, dtype: torch.dtype,
                      device: torch.device, tp: TPShard | None = None) -> None:
    """Replace the FP8 linears of `model` (a DecoderLM on the meta device, before to_empty; one pipeline stage's
    layers when built so) by Fp8Linears holding the checkpoint's bytes on `device` (engine/models/loader.py's
    build_model calls it; its load_weights then fills every float parameter left). Refuses an FP8 tensor it
    did not place (an LM head, an embedding, an expert). With `tp`, this rank's shard of each (module docstring)."""
    if model.spec.moe is not None:
        raise ValueError(f"a {scheme.method} FP8 mixture-of-experts model is not supported")
    ckpt = Checkpoint(model_dir)
    wrong = sorted(n for n, d in ckpt.dtypes.items() if d.startswith("F8_") and d != E4M3_DTYPE)
    if wrong:
        raise ValueError(f"checkpoint {model_dir!r} holds {ckpt.dtypes[wrong[0]]} tensors ({wrong[:4]}); FP8 "
                         "weights run as e4m3 (F8_E4M3) only")
    placed: set[str] = set()
    first, end = model.layer_range
    for i, layer in zip(range(first, end), model.layers):
        for sub, attr, parts in _LINEARS:
            base = f"model.layers.{i}.{sub}"
            names = [f"{base}.{attr}"] if f"{base}.{attr}.weight" in ckpt else [f"{base}.{p}" for p in parts]
            placed.update(_place_linear(ckpt, scheme, getattr(layer, sub), attr, names, dtype, device, tp))
    unplaced = sorted(n for n, d in ckpt.dtypes.items() if d == E4M3_DTYPE and n not in placed
                      and in_stage(n, first, end))
    if unplaced:
        raise ValueError(f"checkpoint {model_dir!r} holds FP8 tensors Tandem runs only in float: {unplaced[:8]}")


def _place_linear(ckpt: Checkpoint, scheme: Fp8Scheme, owner: nn.Module, attr: str, names: list[str],
                  dtype: torch.dtype, device: torch.device, tp: TPShard | None = None) -> list[str]:
    """owner.attr := an Fp8Linear of the rows of `names` stacked, when the checkpoint holds them in e4m3 (a
    float linear is left for load_weights); with `tp`, of this rank's rows (and their scales and biases) or input
    columns (the row scales and bias whole). Returns the weight names placed."""
    fp8 = [ckpt.dtypes.get(f"{n}.weight") == E4M3_DTYPE for n in names]
    if not any(fp8):
        return []
    if not all(fp8):
        raise ValueError(f"the checkpoint holds some of {names} in FP8 and not the others")
    weights = [ckpt.get(f"{n}.weight") for n in names]
    scales = [_row_scales(scheme, ckpt.get(f"{n}.weight_scale"), w.shape[0], n) for n, w in zip(names, weights)]
    input_scales = [_input_scale(ckpt, n) for n in names] if scheme.activations == "tensor" else None
    biases = [ckpt.get(f"{n}.bias") for n in names if f"{n}.bias" in ckpt]
    if tp is not None:  # a fused checkpoint tensor (Phi-3's qkv_proj) is shard WHOLE: its sections sliced each
        shards = range(len(names)) if len(names) > 1 else [WHOLE]
        weights = [take_shard(w, f"{attr}.weight", i, tp).clone(memory_format=torch.contiguous_format)
                   for i, w in zip(shards, weights)]
        scales = [take_shard(s, f"{attr}.weight_scale", i, tp) for i, s in zip(shards, scales)]
        biases = [take_shard(b, f"{attr}.bias", i, tp) for i, b in zip(shards, biases)]
    setattr(owner, attr, Fp8Linear(
        torch.cat(weights).to(device), torch.cat(scales).to(device),
        torch.cat(biases).to(device) if biases else None, scheme.activations, dtype, input_scales,
        [w.shape[0] for w in weights], scheme.scale_ub))
    return [f"{n}.weight" for n in names]


def _row_scales(scheme: Fp8Scheme, scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """One linear's weight_scale as fp32 [rows]: a per-tensor scale repeated on every row (exact)."""
    if scale.numel() == 1 and scheme.weights == "tensor":
        return scale.float().reshape(1).expand(rows)
    if scale.numel() != rows or scheme.weights != "channel" or scale.dim() > 2:
        raise ValueError(f"{name}.weight_scale of shape {tuple(scale.shape)} does not fit {scheme.weights} scales "
                         f"of {rows} rows")
    return scale.float().reshape(rows)


def _input_scale(ckpt: Checkpoint, name: str) -> float:
    scale = ckpt.get(f"{name}.input_scale")
    if scale.numel() != 1:
        raise ValueError(f"{name}.input_scale of shape {tuple(scale.shape)} is not one static per-tensor scale")
    return float(scale.float().reshape(()))
