"""Compile the Triton attention, fused-MoE, fused-forward and int4 GEMM kernels for a GPU target without a GPU
(Triton ships its own ptxas).

    python scripts/compile_kernels.py [--arch 90] [--only attention|moe|fused|int4]

Catches what the Triton interpreter cannot (type errors in the generated IR, unsupported ops, tl.dot shape
rules) and prints each variant's registers, spills and shared memory. The CPU test suite runs it; on the GPU
machine the same variants are also compiled and run by the gpu-marked tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import kv_dtype  # noqa: E402
from engine.attention import triton_paged as tp  # noqa: E402
from engine.models import fused_kernels as fk  # noqa: E402
from engine.models import int4_triton as i4  # noqa: E402
from engine.models import moe_triton as mt  # noqa: E402

# (label, dtype, head_dim, group, block_size, decode, splits, sliding[, softcap[, merge_here[, KV cache dtype]]])
ATTENTION_VARIANTS = [
    ("qwen2.5-0.5b decode", "bf16", 64, 7, 16, True, 1, False),
    ("qwen2.5-0.5b decode split", "bf16", 64, 7, 16, True, 8, False),
    ("llama-3.2-1b decode split", "bf16", 64, 4, 16, True, 16, False),
    # Llama-3.1-8B: head_dim 128, 32 query heads over 8 KV heads (GQA group 4)
    ("llama-3.1-8b decode", "bf16", 128, 4, 16, True, 1, False),
    ("llama-3.1-8b decode split", "bf16", 128, 4, 16, True, 16, False),
    ("llama-3.1-8b prefill", "bf16", 128, 4, 16, False, 1, False),
    ("qwen2.5-1.5b prefill", "bf16", 128, 6, 16, False, 1, False),
    ("mistral prefill sliding", "bf16", 128, 4, 16, False, 1, True),
    ("fp32 prefill (tests)", "fp32", 32, 2, 4, False, 1, False),
    ("fp32 decode split (tests)", "fp32", 16, 2, 4, True, 4, True),
    ("block 256 decode (flash-attn size)", "fp16", 128, 8, 256, True, 2, False),
    # Gemma: head_dim 256; Gemma 2 soft-caps the scores (2B: 8 query heads over 4 KV heads), Gemma 3 1B is MQA
    ("gemma-2-2b decode softcap sliding", "bf16", 256, 2, 16, True, 1, True, True),
    ("gemma-2-2b decode split softcap", "bf16", 256, 2, 16, True, 8, False, True),
    ("gemma-2-2b prefill softcap sliding", "bf16", 256, 2, 16, False, 1, True, True),
    ("gemma-3-1b decode sliding", "bf16", 256, 4, 16, True, 1, True),
    ("gemma-3-1b prefill", "bf16", 256, 4, 16, False, 1, False),
    # the fused forward's one-launch split-K: the last split merges (MERGE_HERE)
    ("qwen2.5-0.5b decode split, merged here", "bf16", 64, 7, 16, True, 16, False, False, True),
    ("llama-3.1-8b decode split, merged here", "bf16", 128, 4, 16, True, 16, False, False, True),
    ("gemma-2-2b decode split softcap, merged", "bf16", 256, 2, 16, True, 8, False, True, True),
    # kv_cache_dtype: fp8 (e4m3) K/V dequantized to the model's dtype as they are read; bf16 K/V under fp32
    ("llama-3.1-8b decode fp8 KV", "bf16", 128, 4, 16, True, 1, False, False, False, "fp8e4nv"),
    ("llama-3.1-8b decode split fp8, merged", "bf16", 128, 4, 16, True, 16, False, False, True, "fp8e4nv"),
    ("llama-3.1-8b prefill fp8 KV", "bf16", 128, 4, 16, False, 1, False, False, False, "fp8e4nv"),
    ("gemma-2-2b prefill softcap fp8 KV", "bf16", 256, 2, 16, False, 1, True, True, False, "fp8e4nv"),
    ("fp32 decode bf16 KV (tests)", "fp32", 64, 3, 16, True, 4, False, False, False, "bf16"),
]


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> ASTSource:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})


def _kv_mode(dtype: str, kv: str | None) -> int:
    return kv_dtype.KV_SAME if kv in (None, dtype) else kv_dtype.KV_FP8 if kv.startswith("fp8") else kv_dtype.KV_CAST


def attention_variant(dtype: str, head_dim: int, group: int, block_size: int, decode: bool, splits: int,
                      sliding: bool, softcap: bool = False, merge_here: bool = False,
                      kv: str | None = None) -> tuple[ASTSource, int]:
    block_m = tp._dim(group) if decode else tp.prefill_block_m(group, head_dim)
    block_n, num_warps = tp.launch_config(head_dim, decode, fp8=kv is not None and kv.startswith("fp8"))
    cx = dict(NUM_HEADS=group * 2, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=tp._dim(head_dim),
              BLOCK_SIZE=block_size, BLOCK_Q=1 if decode else block_m // group, BLOCK_M=block_m, BLOCK_N=block_n,
              NUM_SPLITS=splits, DECODE=decode, SLIDING=sliding, SOFTCAP=softcap,
              PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False, MERGE_HERE=merge_here,
              KV=_kv_mode(dtype, kv))
    ptr, cache = f"*{dtype}", f"*{kv or dtype}"
    pointers = {"q_ptr": ptr, "kc_ptr": cache, "vc_ptr": cache, "out_ptr": ptr, "part_acc_ptr": "*fp32",
                "part_ml_ptr": "*fp32", "ticket_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
                "bt_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    return _signature(tp._paged_attention_kernel, pointers, cx), num_warps


def store_variant(dtype: str, kv_heads: int, head_dim: int, block_size: int, kv: str | None = None) -> ASTSource:
    pointers = {n: f"*{dtype}" for n in ("k_ptr", "v_ptr")} | {n: f"*{kv or dtype}" for n in ("kc_ptr", "vc_ptr")}
    pointers |= {"slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    return _signature(tp._store_kv_kernel, pointers,
                      dict(NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=tp._pow2(kv_heads),
                           BLOCK_D=tp._pow2(head_dim), BLOCK_SIZE=block_size, KV=_kv_mode(dtype, kv)))


def merge_variant(num_heads: int, head_dim: int, splits: int) -> ASTSource:
    return _signature(tp._merge_splits_kernel, {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                                                 "out_ptr": "*bf16"},
                      dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=tp._dim(head_dim), NUM_SPLITS=splits))


def other_kernels() -> list[tuple[str, tuple[ASTSource, int]]]:
    return [("store_kv bf16", (store_variant("bf16", 2, 64, 16), 4)),
            ("store_kv bf16 llama-3.1-8b", (store_variant("bf16", 8, 128, 16), 4)),
            ("store_kv fp32 MQA, block 12", (store_variant("fp32", 1, 32, 12), 4)),
            ("store_kv fp8 KV llama-3.1-8b", (store_variant("bf16", 8, 128, 16, "fp8e4nv"), 4)),
            ("store_kv bf16 KV under fp32", (store_variant("fp32", 3, 64, 16, "bf16"), 4)),
            ("merge_splits 8", (merge_variant(14, 64, 8), 4)),
            ("merge_splits 16 llama-3.1-8b", (merge_variant(32, 128, 16), 4))]


# (label, dtype, routing-weight dtype, N, K, top_k, gated, BLOCK_M): the gate_up (gated, SiLU * up) and down
# GEMMs of real shapes; Mixtral scales by fp32 routing weights, Qwen by weights in the model dtype.
MOE_VARIANTS = [
    ("mixtral-8x7b gate_up decode", "bf16", "fp32", 14336, 4096, 2, True, 16),
    ("mixtral-8x7b down prefill", "bf16", "fp32", 4096, 14336, 1, False, 64),
    ("qwen1.5-moe gate_up prefill", "bf16", "bf16", 1408, 2048, 4, True, 64),
    ("qwen3-30b-a3b down decode", "bf16", "bf16", 2048, 768, 1, False, 16),
    ("fp32 gate_up (tests)", "fp32", "fp32", 32, 64, 2, True, 16),
    ("fp32 down (tests)", "fp32", "fp32", 64, 32, 1, False, 16),
]


def moe_variant(dtype: str, weights: str, n: int, k: int, top_k: int, gated: bool,
                block_m: int) -> tuple[ASTSource, int]:
    block_n, block_k, num_warps = mt.tile_config(n, k, block_m, dtype == "fp32")
    ptr = f"*{dtype}"
    pointers = {"a_ptr": ptr, "w_ptr": ptr, "c_ptr": ptr, "weights_ptr": f"*{weights}",
                "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
    cx = dict(TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
              PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False)
    return _signature(mt._moe_gemm_kernel, pointers, cx), num_warps


def fused_kernels() -> list[tuple[str, tuple[ASTSource, int]]]:
    """The fused forward's kernels (engine/models/fused_kernels.py) at real shapes, with their launch warps."""
    def norm(dtype, n, pre, unit):
        block = fk._pow2(n)
        ptrs = {k: f"*{dtype}" for k in ("x_ptr", "res_ptr", "pre_w_ptr", "w_ptr", "out_ptr", "stream_ptr")}
        cx = dict(HAS_RESIDUAL=True, PRE_NORM=pre, UNIT_OFFSET=unit, BLOCK_N=block)
        return _signature(fk._add_rms_norm_kernel, ptrs | {"eps": "fp32"}, cx), fk._row_warps(block)

    def rope(dtype, h, hkv, d, rot, qk_norm, unit, kv=None):
        ptrs = {k: f"*{dtype}" for k in ("qkv_ptr", "qn_ptr", "kn_ptr", "q_ptr")}
        ptrs |= {k: f"*{kv or dtype}" for k in ("kc_ptr", "vc_ptr")}
        ptrs |= {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
        cx = dict(NUM_HEADS=h, NUM_KV_HEADS=hkv, HEAD_DIM=d, HALF=rot // 2, BLOCK_D=fk._pow2(d), BLOCK_SIZE=16,
                  QK_NORM=qk_norm, UNIT_OFFSET=unit, KV=_kv_mode(dtype, kv))
        return _signature(fk._rope_store_kernel, ptrs, cx), 1 if d <= 128 else 2

    def gate_up(dtype, m, n, k, act, bias):
        block_m, block_n, block_k, warps = fk.gemm_tiles(m, n, k, dtype == "fp32")
        ptrs = {k_: f"*{dtype}" for k_ in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}
        cx = dict(HAS_BIAS=bias, ACT=fk.ACTIVATIONS[act], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False)
        return _signature(fk._gate_up_act_kernel, ptrs, cx), warps

    act_mul = _signature(fk._act_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"},
                         dict(ACT=0, BLOCK_N=1024)), 4
    return [("add_rms_norm qwen2.5-0.5b (896)", norm("bf16", 896, False, False)),
            ("add_rms_norm llama-3.1-8b (4096)", norm("bf16", 4096, False, False)),
            ("add_rms_norm gemma sandwich (2304)", norm("bf16", 2304, True, True)),
            ("rope_store qwen2.5-0.5b", rope("bf16", 14, 2, 64, 64, False, False)),
            ("rope_store llama-3.1-8b", rope("bf16", 32, 8, 128, 128, False, False)),
            ("rope_store qwen3 q/k norm", rope("bf16", 16, 8, 128, 128, True, False)),
            ("rope_store gemma-3 256 q/k norm", rope("bf16", 4, 1, 256, 256, True, True)),
            ("rope_store phi-4-mini partial", rope("bf16", 24, 8, 128, 96, False, False)),
            ("rope_store llama-3.1-8b fp8 KV", rope("bf16", 32, 8, 128, 128, False, False, "fp8e4nv")),
            ("gate_up_act llama-3.2-1b decode", gate_up("bf16", 1, 8192, 2048, "silu", False)),
            ("gate_up_act llama-3.2-1b prefill", gate_up("bf16", 512, 8192, 2048, "silu", False)),
            ("gate_up_act gemma-2-2b decode", gate_up("bf16", 8, 9216, 2304, "gelu_pytorch_tanh", False)),
            ("gate_up_act fp32 (tests)", gate_up("fp32", 5, 128, 64, "silu", True)),
            ("act_mul bf16", act_mul)]


# (label, dtype, M, N, K, group, bias): Llama-3.2-1B's linears (q/k/v fused to 3072 outputs, gate/up to 16384)
# at decode (M 1), a decode batch (M 32) and prefill (M 512), GPTQ's usual group 128; groups of 32 take the
# per-plane scales; Qwen2's q/k/v bias; fp16 and the tests' fp32.
INT4_VARIANTS = [
    ("int4 o_proj M1", "bf16", 1, 2048, 2048, 128, False),
    ("int4 qkv+bias M1", "bf16", 1, 3072, 2048, 128, True),
    ("int4 gate_up M1", "bf16", 1, 16384, 2048, 128, False),
    ("int4 down M1", "bf16", 1, 2048, 8192, 128, False),
    ("int4 k_proj 512 M1", "bf16", 1, 512, 2048, 128, False),
    ("int4 o_proj M32", "bf16", 32, 2048, 2048, 128, False),
    ("int4 gate_up M32", "bf16", 32, 16384, 2048, 128, False),
    ("int4 gate_up M512", "bf16", 512, 16384, 2048, 128, False),
    ("int4 o_proj g32 M1", "bf16", 1, 2048, 2048, 32, False),
    ("int4 down fp16 M32", "fp16", 32, 2048, 8192, 128, False),
    ("int4 fp32 g32 M3 (tests)", "fp32", 3, 96, 256, 32, True),
]


def int4_variant(dtype: str, m: int, n: int, k: int, group: int, bias: bool) -> tuple[ASTSource, int]:
    block_m, block_n, splits, warps = i4.tiles(m, n, -(-k // i4.CHUNK))
    ptrs = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "z_ptr": "*u8", "s_ptr": "*fp16", "b_ptr": "*fp32",
            "out_ptr": "*fp32" if splits > 1 else f"*{dtype}"}
    cx = dict(ALIGNED=group % i4.CHUNK == 0, SPLIT=splits > 1, HAS_BIAS=bias, BLOCK_M=block_m, BLOCK_N=block_n,
              PRECISION="ieee" if dtype == "fp32" else None, UPCAST=False)
    return _signature(i4._int4_gemm_kernel, ptrs, cx), warps


def int4_kernels() -> list[tuple[str, tuple[ASTSource, int]]]:
    """The int4 GEMM (engine/models/int4_triton.py) at real shapes, and its split-K sum."""
    work = []
    for label, *v in INT4_VARIANTS:
        splits = i4.tiles(v[1], v[2], -(-v[3] // i4.CHUNK))[2]
        work.append((f"{label}, split {splits}", int4_variant(*v)))
    sums = _signature(i4._sum_splits_kernel, {"part_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16"},
                      dict(SPLITS=8, HAS_BIAS=True, BLOCK_N=1024))
    return work + [("int4 sum of 8 splits + bias", (sums, 4))]


def resource_usage(cubin: bytes) -> str:
    """REG / STACK / LOCAL (spills) of the kernel, read by the cuobjdump Triton bundles (if present)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "-"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return f"{fields.get('REG', '?'):>4} {fields.get('STACK', '?'):>5} {fields.get('LOCAL', '?'):>5}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    ap.add_argument("--only", choices=("attention", "moe", "fused", "int4"),
                    help="compile one group of kernels (default: all)")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    work = []
    if args.only in (None, "attention"):
        work += [(label, attention_variant(*v)) for label, *v in ATTENTION_VARIANTS] + other_kernels()
    if args.only in (None, "moe"):
        work += [(label, moe_variant(*v)) for label, *v in MOE_VARIANTS]
    if args.only in (None, "fused"):
        work += fused_kernels()
    if args.only in (None, "int4"):
        work += int4_kernels()
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    print(f"{'kernel variant':38} {'shared B':>8} {'REG':>4} {'STACK':>5} {'LOCAL':>5}")
    for label, (src, num_warps) in work:
        k = triton.compile(src, target=target, options={"num_warps": num_warps})
        print(f"{label:38} {k.metadata.shared:>8} {resource_usage(k.asm['cubin'])}")
    print("all kernels compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
