"""The Triton paged-attention kernels against the pure-PyTorch reference (engine/attention/torch_paged.py).

On a CPU machine the kernels run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); on a GPU machine the same cases run compiled on CUDA (marked gpu). The reference runs in
float64 on the CPU. Cases cover decode and prefill over a cached prefix in one batch, ragged lengths, block
sizes (including non-powers of two), GQA ratios (MHA, 2, 4, 7, MQA), sliding windows, Gemma 2's score
soft-cap (with Gemma's head_dim 256), flash-decoding splits and padding slots (-1), with outputs poisoned
before each run so an unwritten element fails.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.attention import (AttentionMetadata, LayerAttention, TorchPagedAttention, flash, resolve_backend,
                              triton_paged)

interpreted = pytest.mark.skipif(not triton_paged.INTERPRETED,
                                 reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1, set without CUDA)")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative L2 error

pytestmark = pytest.mark.skipif(not triton_paged.AVAILABLE, reason="triton is not installed")


@dataclass
class Case:
    q_lens: list[int]  # tokens of each chunk in this step (1 = decode)
    ctx_lens: list[int]  # positions already cached before the chunk
    block_size: int
    num_kv_heads: int
    group: int  # query heads per kv head
    head_dim: int = 32
    window: int | None = None
    splits: int | None = None  # None: the kernel's own choice
    softcap: float | None = None


CASES = {
    "decode_mha_bs16": Case([1, 1, 1, 1], [0, 15, 16, 70], 16, 4, 1),
    "decode_gqa2_bs4_ragged": Case([1] * 6, [3, 9, 17, 33, 40, 1], 4, 2, 2, head_dim=16),
    "decode_gqa4_split3": Case([1, 1, 1], [5, 64, 130], 8, 2, 4, splits=3),
    "decode_mqa7_bs12": Case([1, 1], [50, 11], 12, 1, 7),
    "prefill_fresh_gqa2": Case([37, 5], [0, 0], 16, 2, 2),
    "prefill_cached_prefix_bs4": Case([9, 20], [13, 4], 4, 2, 2, head_dim=16),
    "mixed_decode_prefill_gqa4": Case([1, 23, 1, 7], [40, 9, 2, 0], 16, 2, 4, head_dim=64),
    "mixed_block1": Case([3, 1, 5], [2, 6, 0], 1, 2, 2, head_dim=16),
    "sliding_window_prefill": Case([30, 1, 12], [10, 44, 0], 8, 2, 2, window=7),
    "sliding_window_decode_split": Case([1, 1, 1], [60, 3, 25], 4, 2, 2, window=24, splits=4),
    "softcap_mixed_window": Case([1, 19, 1], [40, 9, 3], 8, 2, 2, window=12, softcap=2.0),
    "softcap_decode_split": Case([1, 1], [70, 33], 4, 1, 4, softcap=1.5, splits=4),
    "gemma_head_dim_256_prefill": Case([21, 1, 40], [5, 30, 0], 16, 2, 2, head_dim=256, window=12, softcap=3.0),
}


def make_inputs(case: Case, dtype: torch.dtype, seed: int):
    """Random caches holding each sequence's prefix in shuffled blocks, plus the step's q/k/v."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    seq_lens = [q + c for q, c in zip(case.q_lens, case.ctx_lens)]
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    slots = [t[p // bs] * bs + p % bs for t, c, n in zip(tables, case.ctx_lens, seq_lens) for p in range(c, n)]
    width = max(len(t) for t in tables) + 1  # a spare column: tables are padded like the engine's
    qsl = [0]
    for n in case.q_lens:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    tensors = dict(q=rand(t, hkv * case.group, d), k=rand(t, hkv, d), v=rand(t, hkv, d),
                   k_cache=rand(num_blocks, bs, hkv, d), v_cache=rand(num_blocks, bs, hkv, d))
    tensors = {name: x.to(dtype) for name, x in tensors.items()}  # round once; the reference upcasts these
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32),
        block_size=bs, query_lens_host=list(case.q_lens), seq_lens_host=seq_lens)
    return tensors, meta


def meta_to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping.to(device), meta.query_start_loc.to(device),
                             meta.seq_lens.to(device), meta.block_tables.to(device), meta.block_size,
                             meta.query_lens_host, meta.seq_lens_host)


def reference(case: Case, x: dict, meta: AttentionMetadata):
    """float64 PyTorch paged attention; returns (output, k_cache, v_cache) after the step's store."""
    x = {name: t.double().clone() for name, t in x.items()}
    ref = TorchPagedAttention(case.window)
    ref.prepare(meta)
    out = ref.forward(x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], meta, case.head_dim ** -0.5,
                      LayerAttention(case.window, case.softcap))
    return out, x["k_cache"], x["v_cache"]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(name, dtype, device):
    case = CASES[name]
    x, meta = make_inputs(case, dtype, seed=list(CASES).index(name))
    ref_out, ref_k, ref_v = reference(case, x, meta)
    dev = {n: t.to(device) for n, t in x.items()}
    out = torch.full_like(dev["q"], float("nan"))  # poisoned: every element must be written
    dmeta = meta_to(meta, device)
    triton_paged.store_kv_triton(dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], dmeta.slot_mapping)
    triton_paged.paged_attention_triton(dev["q"], dev["k_cache"], dev["v_cache"], dmeta,
                                        case.head_dim ** -0.5, case.window, block_n=16, num_splits=case.splits,
                                        out=out, softcap=case.softcap)
    assert not out.isnan().any(), "unwritten or NaN output elements"
    assert rel_err(out, ref_out) < TOL[dtype]
    # The store wrote exactly the step's slots, bit for bit (the reference stores the same rounded values).
    assert torch.equal(dev["k_cache"].cpu().double(), ref_k) and torch.equal(dev["v_cache"].cpu().double(), ref_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.splits])
def test_split_merged_by_its_last_program_matches_reference(name, dtype, device):
    """merge_in_kernel (the fused forward's one-launch split-K): the split that finishes last merges; run
    twice, since each launch must leave its tickets at zero for the next (a stale ticket would skip or
    double a merge and leave poisoned rows)."""
    case = CASES[name]
    x, meta = make_inputs(case, dtype, seed=list(CASES).index(name))
    ref_out, _, _ = reference(case, x, meta)
    dev = {n: t.to(device) for n, t in x.items()}
    dmeta = meta_to(meta, device)
    triton_paged.store_kv_triton(dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], dmeta.slot_mapping)
    for _ in range(2):
        out = torch.full_like(dev["q"], float("nan"))
        triton_paged.paged_attention_triton(dev["q"], dev["k_cache"], dev["v_cache"], dmeta, case.head_dim ** -0.5,
                                            case.window, block_n=16, num_splits=case.splits, out=out,
                                            softcap=case.softcap, merge_in_kernel=True)
        assert not out.isnan().any(), "a row no program merged"
        assert rel_err(out, ref_out) < TOL[dtype]
        assert not triton_paged._TICKETS[out.device].any(), "tickets not reset for the next launch"


@pytest.mark.parametrize("device", DEVICES)
def test_store_skips_padding_slots(device):
    """slot -1 (graph padding rows) writes nothing; the other rows land in their slots."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 4, 2, 16, generator=g).to(device)
    v_cache = torch.randn(6, 4, 2, 16, generator=g).to(device)
    k, v = torch.randn(5, 2, 16, generator=g).to(device), torch.randn(5, 2, 16, generator=g).to(device)
    slots = torch.tensor([7, -1, 0, -1, 23], device=device)
    want_k, want_v = k_cache.clone().view(-1, 2, 16), v_cache.clone().view(-1, 2, 16)
    for row, slot in enumerate([7, -1, 0, -1, 23]):
        if slot >= 0:
            want_k[slot], want_v[slot] = k[row], v[row]
    triton_paged.store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16), want_k) and torch.equal(v_cache.view(-1, 2, 16), want_v)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_decode_rows_are_inert(device):
    """A CUDA-graph batch padded with empty sequences (seq_len 0) gives zeros there and leaves real rows exact."""
    case = Case([1, 1, 1], [12, 30, 5], 4, 2, 2, head_dim=16)
    x, meta = make_inputs(case, torch.float32, seed=5)
    ref_out, _, _ = reference(case, x, meta)
    pad = 2
    padded = AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1)]),
        query_start_loc=torch.arange(4 + pad, dtype=torch.int32),
        seq_lens=torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32)]),
        block_size=4)
    q = torch.cat([x["q"], torch.randn(pad, *x["q"].shape[1:])]).to(device)
    k = torch.cat([x["k"], torch.randn(pad, *x["k"].shape[1:])]).to(device)
    v = torch.cat([x["v"], torch.randn(pad, *x["v"].shape[1:])]).to(device)
    k_cache, v_cache = x["k_cache"].to(device), x["v_cache"].to(device)
    backend = triton_paged.TritonPagedAttention(block_n=16)
    out = backend.forward(q, k, v, k_cache, v_cache, meta_to(padded, device), case.head_dim ** -0.5)
    assert rel_err(out[:3], ref_out) < TOL[torch.float32]
    assert torch.equal(out[3:].cpu(), torch.zeros(pad, *out.shape[1:]))


@interpreted
def test_random_ragged_batches_cpu():
    """Fuzz: random mixes of decode and prefill chunks, block sizes and GQA ratios (fp32)."""
    rng = random.Random(7)
    for trial in range(6):
        n = rng.randint(1, 5)
        case = Case(q_lens=[rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(n)],
                    ctx_lens=[rng.randint(0, 60) for _ in range(n)], block_size=rng.choice([2, 4, 5, 16]),
                    num_kv_heads=rng.choice([1, 2]), group=rng.choice([1, 2, 3, 4]), head_dim=16,
                    window=rng.choice([None, None, 9]), splits=rng.choice([None, 2]))
        x, meta = make_inputs(case, torch.float32, seed=trial)
        ref_out, _, _ = reference(case, x, meta)
        out = triton_paged.paged_attention_triton(
            x["q"], *_stored(x, meta), meta, case.head_dim ** -0.5, case.window, block_n=16,
            num_splits=case.splits)
        assert rel_err(out, ref_out) < TOL[torch.float32], case


def _stored(x: dict, meta: AttentionMetadata):
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    triton_paged.store_kv_triton(x["k"], x["v"], k_cache, v_cache, meta.slot_mapping)
    return k_cache, v_cache


def test_backend_resolution_and_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, 16) == "cpu"  # the native decode kernel builds on these machines
    assert resolve_backend("auto", cuda, 16) == ("triton" if triton_paged.AVAILABLE else "torch")
    if triton_paged.INTERPRETED:
        assert resolve_backend("triton", cpu, 16) == "triton"
    else:
        with pytest.raises(ValueError, match="runs on cuda"):
            resolve_backend("triton", cpu, 16)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton, flash_attn"):
        resolve_backend("xformers", cpu, 16)
    with pytest.raises(ValueError, match="'cpu' runs on cpu"):
        resolve_backend("cpu", cuda, 16)
    with pytest.raises(ValueError, match="flash_attn"):
        resolve_backend("flash_attn", cuda, 16)  # not installed here, or block_size not a multiple of 256


def test_flash_attn_without_softcap_is_not_picked_for_soft_capped_models(monkeypatch, caplog):
    """flash-attn < 2.6 has no `softcap`: "auto" passes over it for a soft-capped model (Gemma 2), naming it is a
    ValueError saying why, and models without a soft-cap still get it. A stand-in flash_attn module (the real
    one is not installed here) with each release's signature."""
    cuda = torch.device("cuda")

    def old_api(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), block_table=None):
        raise AssertionError("not called")

    def new_api(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):
        raise AssertionError("not called")

    monkeypatch.setattr(flash, "AVAILABLE", True)
    try:
        for api, capable in ((old_api, False), (new_api, True)):
            fake = types.ModuleType("flash_attn")
            fake.flash_attn_varlen_func = fake.flash_attn_with_kvcache = api
            monkeypatch.setitem(sys.modules, "flash_attn", fake)
            flash.supports_softcap.cache_clear()
            assert flash.supports_softcap() is capable
            assert resolve_backend("auto", cuda, 256) == "flash_attn"
            assert resolve_backend("flash_attn", cuda, 256) == "flash_attn"
            if capable:
                assert resolve_backend("auto", cuda, 256, softcap=True) == "flash_attn"
                assert resolve_backend("flash_attn", cuda, 256, softcap=True) == "flash_attn"
                continue
            with caplog.at_level(logging.INFO, logger="engine.attention"):
                picked = resolve_backend("auto", cuda, 256, softcap=True)
            assert picked == ("triton" if triton_paged.AVAILABLE else "torch")
            assert "cannot soft-cap" in caplog.text
            with pytest.raises(ValueError, match="'flash_attn' cannot soft-cap .* older than 2.6"):
                resolve_backend("flash_attn", cuda, 256, softcap=True)
    finally:
        flash.supports_softcap.cache_clear()


def test_modules_import_without_triton():
    """The CUDA-only modules import on a machine without Triton, and asking for the backend says why not."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from engine.attention import get_backend, resolve_backend, triton_paged\n"
        "import engine.cuda_graphs, engine.model_runner, engine.attention.flash\n"
        "assert not triton_paged.AVAILABLE\n"
        "try:\n    resolve_backend('triton', torch.device('cpu'), 16)\nexcept ValueError as e:\n    print('E1', e)\n"
        "try:\n    get_backend('triton')\nexcept ValueError as e:\n    print('E2', e)\n"
        "print('auto', resolve_backend('auto', torch.device('cuda'), 16))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "E1 attention_backend 'triton' cannot run here: the triton package is not installed" in res.stdout
    assert "E2 attention backend 'triton' needs the triton package" in res.stdout
    assert "auto torch" in res.stdout


def test_kernels_compile_for_hopper():
    """Compile every kernel variant for sm_90 with Triton's bundled ptxas (no GPU needed): catches IR type
    errors and tl.dot shape rules the interpreter does not check, and register spills."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"
    res = subprocess.run([sys.executable, str(script), "--arch", "90"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "all kernels compiled" in res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line and line.split()[-1].isdigit()]
    assert all(row[-2:] == ["0", "0"] for row in rows), f"register spills (STACK/LOCAL):\n{res.stdout}"


@pytest.mark.gpu
@pytest.mark.skipif(not flash.AVAILABLE, reason="flash_attn is not installed (optional; no wheels on PyPI)")
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_flash_attn_backend_matches_reference(name):
    case = {"decode": Case([1, 1, 1], [300, 5, 700], 256, 2, 4, head_dim=64),
            "mixed": Case([1, 40, 1], [300, 200, 0], 256, 2, 4, head_dim=64)}[name]
    x, meta = make_inputs(case, torch.bfloat16, seed=9)
    ref_out, _, _ = reference(case, x, meta)
    dev = {n: t.to("cuda") for n, t in x.items()}
    backend = flash.FlashAttnPagedAttention()
    out = backend.forward(dev["q"], dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], meta_to(meta, "cuda"),
                          case.head_dim ** -0.5)
    assert rel_err(out, ref_out) < TOL[torch.bfloat16]
