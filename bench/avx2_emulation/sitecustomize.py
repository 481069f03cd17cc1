"""Loaded by every Python process of a benchmark run with `--emulate-avx2` (bench/bench_peer_cpu.py puts this
folder on PYTHONPATH): a CPU with AVX-512 runs as one without, for the peers too.

PyTorch's and oneDNN's kernels follow ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 (set by the
benchmark), and so do Tandem's (engine/cpu/kernels.py follows PyTorch's level). vLLM's CPU build picks its
own kernel library from the hardware (`torch.cpu._is_avx512_supported()`, which reads the CPU, not the
variable), so here that answer is the one an AVX2-only CPU gives, and vLLM loads its _C_AVX2 build."""

import os

if os.environ.get("TANDEM_EMULATE_AVX2") == "1":
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
