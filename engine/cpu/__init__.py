"""Everything the engine runs on a CPU of its own making, in one place:

- kernels.py: builds and loads the C++ kernels below, once per instruction-set level (avx512 | avx2 |
  default, as PyTorch's ATEN_CPU_CAPABILITY);
- decode_attention.cpp, prefill_attention.cpp (with simd.h): paged attention over the KV blocks;
- gemm.cpp: the linears' GEMM over weights packed at load, SiLU * up fused into the gate/up GEMM;
- gemm_quant.cpp, quant.py: weight-only Q8_0 / Q4_1 linears and embeddings in a GGUF file's own blocks;
- fused.cpp: RoPE in place, SiLU * up, residual add + RMSNorm, with PyTorch's arithmetic;
- linear.py: the packed linears the CPU model runs (Tandem's GEMM, else oneDNN's, else F.linear);
- alloc.py: tcmalloc for the engine's processes; block_pool.py: the host KV pool preempted requests go to.

The old module paths (engine.attention.cpu_native, engine.models.cpu_linear, engine.cpu_alloc,
engine.cpu_block_pool) still import, as the same modules.
"""
