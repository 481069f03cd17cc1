"""How big the KV cache can be: a profiling pass, then blocks from what is left (vLLM's profile_run idea).

Before the KV cache exists, the runner runs a dummy step at the engine's limits: one forward of
max_num_batched_tokens tokens spread over max_num_seqs sequences (every row sampled, so the slots' logits
buffers and the LM head's output are live) followed by sampling all rows the expensive way (temperature,
top-k, top-p, logprobs), and a decode-shaped forward at the largest CUDA-graph batch, whose activations
the graphs' private pool will hold. What the device must keep for those besides the KV cache is what the
cache cannot have:

    kv_bytes = usable - in_use - activation_peak - graph_pool
    usable   = device memory x gpu_memory_utilization (CUDA, sim)
    usable   = in use + min(available RAM, cpu_kv_cache_bytes or cpu_memory_utilization x available RAM) (CPU)

CUDA: measured. `in_use` is everything the device holds now (weights, slot buffers, the CUDA context and
library workspaces: total - free from cudaMemGetInfo), the peaks come from torch's allocator statistics
around the dummy steps. CPU: measured too, as the growth of the process's peak resident set across the dummy
step (Linux resets the high-water mark through /proc/self/clear_refs); the budget is cpu_kv_cache_bytes
when set, else cpu_memory_utilization of the RAM available (like vLLM's CPU worker, which takes a fraction of
the node's memory less what the process holds). The pool is zero-filled at allocation, so its pages are
resident at once and an engine started next sees the memory as taken. Simulated device: the same formula
on modelled numbers (weights and buffers from the shape, activations from the widest tensors a forward and
the sampler make, a CUDA context of 500 MB).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CUDA_CONTEXT_BYTES = 500 * 1024**2  # a CUDA context plus cuBLAS workspaces, typical (simulated device only)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The profiling pass's figures (bytes) and the KV budget they leave."""

    usable: float  # what the engine may use in all
    in_use: float  # held before the KV cache: weights, step buffers, context
    activation_peak: float  # the dummy step's peak over what was in use
    graph_pool: float  # the decode graphs' private pool (0 without graphs)
    source: str  # "measured" | "modelled"

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.usable - self.in_use - self.activation_peak - self.graph_pool))

    def stats(self) -> dict:
        return {f"memory_{k}": v for k, v in asdict(self).items()} | {"memory_kv_bytes": self.kv_bytes}


def kv_blocks(plan: MemoryPlan, per_block: int, useful: int, override: int | None) -> int:
    """Blocks for the KV cache: `override` when given, else what the plan leaves, at most `useful` (every
    sequence at max_model_len), at least one."""
    if override is not None:
        return override
    return max(1, min(useful, plan.kv_bytes // per_block))


# ---- measuring ----------------------------------------------------------------------------------------------
class CudaMeter:
    """Peak device memory of what runs inside `with meter:` over what was allocated before (torch's stats)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.peak = 0

    def __enter__(self):
        cuda = self.torch.cuda
        cuda.synchronize(self.device)  # sync-ok: start-up only
        cuda.reset_peak_memory_stats(self.device)
        self._before = cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        cuda = self.torch.cuda
        cuda.synchronize(self.device)  # sync-ok: start-up only
        self.peak = max(self.peak, cuda.max_memory_allocated(self.device) - self._before)
        return False

    def usage(self, utilization: float) -> tuple[float, float]:
        free, total = self.torch.cuda.mem_get_info(self.device)
        return total * utilization, total - free


class HostMeter:
    """Growth of the process's peak resident set over what it held before (Linux), else 0."""

    def __init__(self):
        self.peak = 0

    def __enter__(self):
        _trim_heap()  # else memory freed earlier but kept by malloc hides the step's growth (peak 0)
        self._reset_ok = _reset_peak_rss()
        self._before = _rss_kb("VmRSS")
        return self

    def __exit__(self, *exc):
        if self._reset_ok:
            self.peak = max(self.peak, 1024 * max(0, _rss_kb("VmHWM") - self._before))
        return False

    @staticmethod
    def usage(cap_bytes: int | None, utilization: float) -> tuple[float, float]:
        """(usable, in_use): what the KV cache may have at most on top of what the process holds: the
        configured byte budget, or `utilization` of the RAM available, never more than is available."""
        # Not Linux (no MemAvailable): the explicit budget, else 512 MiB, stands in for the RAM available.
        available = 1024 * _meminfo_kb("MemAvailable") or cap_bytes or 512 * 1024**2
        budget = cap_bytes if cap_bytes is not None else utilization * available
        in_use = 1024 * _rss_kb("VmRSS")
        return in_use + min(budget, available), in_use


def _trim_heap() -> None:
    """Give the free memory glibc's malloc keeps back to the OS (no-op elsewhere), so RSS growth measures
    what a step allocates even in a process that freed a lot before (a large model loaded and dropped)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _rss_kb(field: str) -> int:
    return _proc_kb("/proc/self/status", field)


def _meminfo_kb(field: str) -> int:
    return _proc_kb("/proc/meminfo", field)


def _proc_kb(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def modelled_plan(*, memory_bytes: float, utilization: float, weight_bytes: float, buffer_bytes: float,
                  max_tokens: int, max_seqs: int, hidden: int, intermediate: int, vocab: int, dtype_bytes: int,
                  graphs: bool, mixed_graphs: bool = False) -> MemoryPlan:
    """The simulated device's plan: the same terms from the model's shape. A forward's widest live tensors are
    the MLP's gate/up output [T, 2 x intermediate] beside the residual stream and attention's q/k/v
    [T, ~3 x hidden]; sampling keeps about four [rows, vocab] fp32 tensors (logits copy, probabilities,
    noise, top-k/top-p temporaries). The graphs' pool holds the largest graph's forward: a decode at max_seqs, or
    with mixed-step graphs one of max_tokens."""
    def forward(tokens: int, rows: int) -> float:  # live tensors, plus the LM head's rows in dtype and fp32
        return tokens * (2 * intermediate + 4 * hidden) * dtype_bytes + rows * vocab * (dtype_bytes + 4)
    activation = forward(max_tokens, max_seqs) + 4 * max_seqs * vocab * 4
    return MemoryPlan(usable=memory_bytes * utilization, in_use=weight_bytes + buffer_bytes + CUDA_CONTEXT_BYTES,
                      activation_peak=activation,
                      graph_pool=forward(max_tokens if mixed_graphs else max_seqs, max_seqs) if graphs else 0.0,
                      source="modelled")
