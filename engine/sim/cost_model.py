"""The simulated accelerator's cost model: how long each piece of device work takes, and what the host pays
to launch it. Every constant is here, with where it comes from.

A step's forward is priced as two rooflines added together, because the GEMMs and the attention kernels
are separate kernels with very different arithmetic intensity:

    gemm  = max(bytes_gemm / (BW * bw_fraction), flops_gemm / (FLOPS * flops_fraction))
            bytes_gemm = every layer's weights + the LM head (when a row samples) + activations in and out
                         + the fp32 logits written;  flops_gemm = 2 * params * tokens + 2 * hidden * vocab * rows
    attn  = max(kv_bytes / (BW * bw_fraction * occupancy), attn_flops / (FLOPS * flops_fraction))
            kv_bytes = each row's whole context read once (K and V, every layer) + the new tokens' K/V written,
                       at the KV cache's bytes per value (kv_cache_dtype: 1 for fp8, else the model dtype's);
            attn_flops = 4 * heads * head_dim * layers per (query, key) pair, causal within a chunk;
            occupancy = min(1, work units / SMs): a decode attention kernel runs one unit per (row, head,
            split of 512 keys), so one short row cannot pull the whole HBM bandwidth
    forward = gemm + attn + launch overhead (+ a fitted fixed term on the photon-* profiles)
            launch overhead: one graph replay = graph_launch_s + kernels * kernel_gap_graph_s;
                             eager = kernels * kernel_gap_eager_s, and it cannot end before the host has
                             launched the last kernel (engine/sim/device.py gets the host cost separately)

so a step never beats the weight-bandwidth floor (weight bytes / peak HBM bandwidth): an 8B bf16 decode on
an H100 is never under 16.06 GB / 3.35 TB/s = 4.8 ms. Sampling reads the [rows, vocab] fp32 logits once per
pass its kernels make; copies cost a DMA setup latency plus bytes over PCIe.

Sources. Peak HBM bandwidth, dense (non-sparse) bf16 tensor FLOP/s, SM counts and memory sizes are the
vendors' datasheets: NVIDIA H100 SXM5 (3.35 TB/s, 989 TFLOP/s, 132 SMs, 80 GB), H200 SXM (4.8 TB/s, 989
TFLOP/s, 132 SMs, 141 GB), HGX B200 (8 TB/s, 2.25 PFLOP/s dense, 148 SMs, 180 GB), A100 SXM4 80GB (2.039
TB/s, 312 TFLOP/s, 108 SMs), GeForce RTX 3090 (936 GB/s, 71 TFLOP/s bf16 with fp32 accumulate per the
GA102 whitepaper, 82 SMs, 24 GB). Achievable fractions: gpt-fast reports bs=1 decode at 1,397 of A100's
2,039 GB/s (69%, its whole step, launch gaps included), well-tuned GEMV/paged-attention kernels reach 80-90%
of HBM; prefill GEMMs at large batch commonly run at 55-70% of dense peak (MFU), hence 0.80 and 0.60.
Launch costs: NVIDIA's "Getting started with CUDA Graphs" measures a few microseconds per kernel launched
one by one against about one per kernel inside a graph; PyTorch eager dispatch costs roughly 4-8 us of CPU
per operator on current server CPUs, cudaMemcpyAsync and event records a few us each. Host-to-device
copies over PCIe Gen5 x16 run at ~50 GB/s from pinned memory (64 GB/s theoretical), Gen4 at ~25 GB/s.
These launch and copy figures are typical values, not measurements of a particular machine: the simulated
device is for the host-vs-device interplay (is the host's work hidden under the device's?), not for
predicting one GPU's absolute throughput to a few percent.

The photon-* profiles reproduce the per-step forward and sampling times Photon measured (seed
000_f12b5e9769a509f8.txt, moondream2 at 1, 8 and 32 streams on an RTX 3090 and a B200) with the same
formula: their bandwidth fraction, a fixed per-forward term and a fixed sampling term are fitted to those
six forward and six sampling figures for the `moondream2-text` shape at Photon's context (PHOTON_WORKLOAD;
engine/sim/calibrate.py fits them, within ~8% of every forward and ~13% of every sampling figure);
tests/test_sim_device.py checks the stored profiles against the published numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.models import fused_forward
from engine.models.decoder import ModelSpec

GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One accelerator: datasheet peaks, achievable fractions and launch/copy costs (see the module doc)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peak, no sparsity
    num_sms: int
    pcie_bytes_per_s: float  # achievable pinned host<->device copy bandwidth
    bw_fraction: float = 0.80
    flops_fraction: float = 0.60
    kernel_gap_graph_s: float = 1.5e-6  # device time per kernel inside a replayed graph (tiny kernels'
    # launch latency plus their minimum duration)
    kernel_gap_eager_s: float = 2.5e-6  # ... and per kernel launched one by one (the host ahead of it)
    # ... per kernel of the fused forward's plan inside a graph, where none is tiny: its small-batch GEMMs,
    # attention and norms each take a few microseconds whatever their bytes. None: kernel_gap_graph_s.
    fused_kernel_gap_graph_s: float | None = None
    graph_launch_s: float = 5e-6  # device-side latency of a graph launch
    copy_latency_s: float = 2.5e-6  # per cudaMemcpyAsync on its stream (DMA setup), on top of bytes / PCIe
    # Host (CPU) time the CUDA path spends launching work, which the simulated device charges to the thread
    # that launches (engine/sim/device.py): it is host work the real path does and the sim cannot run.
    host_op_s: float = 5e-6  # one PyTorch eager operator (dispatch + cudaLaunchKernel)
    host_view_s: float = 1.5e-6  # one view-only operator (dispatch, no kernel)
    host_triton_s: float = 10e-6  # one Triton kernel launched from Python
    host_graph_launch_s: float = 8e-6  # one CUDAGraph.replay()
    host_copy_s: float = 5e-6  # one non-blocking copy or event record
    # Tensor parallelism (CostModel tp > 1): the GPU-to-GPU link inside one node. An all-reduce of B bytes over
    # N ranks is priced as a ring: allreduce_latency_s + 2 (N - 1) / N * B / link_bytes_per_s.
    link_bytes_per_s: float = 360 * GB  # achievable per direction (NVLink 4: 450 GB/s peak per direction;
    # a100 NVLink 3: 300 peak, 230 here; b200 NVLink 5: 900 peak, 720 here; typical all-reduce bus bandwidths)
    allreduce_latency_s: float = 8e-6  # a small NCCL all-reduce inside a graph on one NVLink node
    # Host time rank 0 spends per step handing the step's inputs to the other ranks' processes (vLLM: a
    # shared-memory message queue; Tandem on CPU: a gloo broadcast), on top of its own staging.
    host_tp_broadcast_s: float = 30e-6
    # Fitted fixed terms (photon-* profiles only; zero for datasheet profiles).
    forward_fixed_s: float = 0.0
    sample_fixed_s: float = 0.0
    # fp8 conversions (compute capability 8.9+: Hopper, Blackwell, Ada), which an fp8 KV cache's Triton kernels
    # need (engine/kv_dtype.py); the Ampere GPUs (A100, RTX 3090) lack them.
    fp8: bool = True

    def __post_init__(self) -> None:
        if not (0 < self.bw_fraction <= 1 and 0 < self.flops_fraction <= 1):
            raise ValueError(f"{self.name}: achievable fractions must be in (0, 1]")


_GEN5, _GEN4 = 50 * GB, 25 * GB
PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    GpuProfile("h100", memory_bytes=80 * GB, hbm_bytes_per_s=3.35e12, bf16_flops=989e12, num_sms=132,
               pcie_bytes_per_s=_GEN5),
    # kernel_gap_graph_s fitted to the first GPU run's 1-stream Qwen2.5-0.5B step with the eager layers, and
    # fused_kernel_gap_graph_s to the second run's with the fused forward (engine/sim/calibrate.fit_h200*)
    GpuProfile("h200", memory_bytes=141 * GB, hbm_bytes_per_s=4.8e12, bf16_flops=989e12, num_sms=132,
               pcie_bytes_per_s=_GEN5, kernel_gap_graph_s=1.806e-6, fused_kernel_gap_graph_s=3.768e-6),
    GpuProfile("b200", memory_bytes=180 * GB, hbm_bytes_per_s=8.0e12, bf16_flops=2250e12, num_sms=148,
               pcie_bytes_per_s=_GEN5, link_bytes_per_s=720 * GB),
    GpuProfile("a100", memory_bytes=80 * GB, hbm_bytes_per_s=2.039e12, bf16_flops=312e12, num_sms=108,
               pcie_bytes_per_s=_GEN4, kernel_gap_graph_s=2e-6, kernel_gap_eager_s=3e-6, link_bytes_per_s=230 * GB,
               fp8=False),
    # Photon's GPUs, fitted to its tables (see the module doc; `python -m engine.sim.calibrate` re-derives
    # the three fitted constants). Photon's forward is its own implementation, not this decoder, so the
    # per-kernel terms are zero and its launch overhead lives in the fitted forward_fixed_s.
    GpuProfile("photon-3090", memory_bytes=24 * GB, hbm_bytes_per_s=936e9, bf16_flops=71e12, num_sms=82,
               pcie_bytes_per_s=_GEN4, link_bytes_per_s=_GEN4, allreduce_latency_s=20e-6,  # no NVLink: PCIe
               kernel_gap_graph_s=0.0, kernel_gap_eager_s=0.0, graph_launch_s=0.0, bw_fraction=1.0,
               forward_fixed_s=2.125e-3, sample_fixed_s=0.222e-3, fp8=False),
    GpuProfile("photon-b200", memory_bytes=180 * GB, hbm_bytes_per_s=8.0e12, bf16_flops=2250e12, num_sms=148,
               pcie_bytes_per_s=_GEN5, link_bytes_per_s=720 * GB, kernel_gap_graph_s=0.0,
               kernel_gap_eager_s=0.0, graph_launch_s=0.0, bw_fraction=0.49, forward_fixed_s=1.883e-3,
               sample_fixed_s=0.135e-3),
)}
SIM_GPUS = tuple(PROFILES)

# Photon's workload as modelled for the photon-* fit: moondream2's text decoder (model dir
# engine/sim/models/moondream2-text) with an image prefix of 729 tokens plus a short query as the prompt and
# L ~ 110 generated tokens, so a step's mean context is about prompt + L / 2.
PHOTON_WORKLOAD = {"prompt_tokens": 740, "output_tokens": 110}
# Photon's measured steady-state medians (ms): streams -> (forward, sampling, pipelined period, blocking period).
PHOTON_TABLE = {
    "photon-3090": {1: (4.87, 0.20, 5.10, 5.44), 8: (6.66, 0.27, 6.97, 7.52), 32: (10.24, 0.26, 10.52, 11.74)},
    "photon-b200": {1: (2.45, 0.14, 2.63, 3.11), 8: (3.12, 0.14, 3.30, 4.04), 32: (3.80, 0.14, 3.98, 5.55)},
}

# A decoder layer's launches on the CUDA path come from the decoder as built: the fused forward's plan
# (engine/models/fused_forward.layer_launches, which tests/test_fused_forward.py holds to a counted decode
# step). These constants are the eager layer's, for a family the fused forward refuses: PyTorch operators it
# dispatches in bf16, counted with a TorchDispatchMode (unfused RMSNorm: 8 kernels with its casts; RoPE: 10;
# projections, residuals, SiLU*mul), view-only operators, and the Triton attention backend's two launches
# (store K/V, attention); Q/K norm (Qwen3) adds two RMSNorms. EngineConfig.sim_kernels_per_layer overrides
# the kernel count.
LAYER_KERNELS, LAYER_VIEWS, LAYER_TRITON = 38, 13, 2
QK_NORM_KERNELS = 16
# Outside the layers: embedding, final norm, LM head, the logits-row gather and copy, the pending-token
# gather (index_select + index_copy_).
FIXED_KERNELS, FIXED_VIEWS = 14, 4
# Activation bytes a layer moves per token, in units of hidden * dtype bytes (norm, residual, q/k/v, o,
# gate/up/act/down in and out): what keeps a long prefill chunk from being priced as weights alone.
ACT_PASSES_PER_LAYER = 16
ATTN_SPLIT_KEYS = 512  # keys per work unit of a decode attention kernel (flash-decoding split)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What a forward of this model moves and computes, from its shape and dtype."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    layer_weight_bytes: float  # one decoder layer
    head_weight_bytes: float  # the LM head (the tied embedding when tied)
    layer_params: float
    qkv_params: float  # of layer_params, the q/k/v projection: the part of the last layer every row runs
    kv_bytes_per_token: float  # K and V of one position, every layer, at the KV cache's bytes per value
    dtype_bytes: int
    layer_kernels: int  # per layer: PyTorch kernels, then the attention backend's Triton launches
    layer_triton: int
    layer_views: int
    tp: int = 1  # tensor-parallel ranks: every size above is one rank's share
    # Sliding-window layers (Gemma, Mistral): their share of the layers, and the window; the attention kernels read
    # only the window's keys there (whatever the KV layout keeps).
    sliding_share: float = 0.0
    window: int | None = None
    fused: bool = False  # the layers are the fused forward's plan (its kernels priced as such inside a graph)


    @classmethod
    def from_spec(cls, spec: ModelSpec, dtype_bytes: int, kernels_per_layer: int | None = None,
                  tp: int = 1, kv_dtype_bytes: int | None = None,
                  linear_bytes: Callable[[int, int], int] | None = None) -> "ModelCost":
        """`tp` > 1: one rank's share under Megatron sharding (engine/models/tp.py): heads, KV heads (one each
        when there are fewer than ranks: replicated), MLP width and vocabulary split, and the two kernels a
        layer adds for its all-reduces (whose time CostModel.tp_comm_s prices). `kv_dtype_bytes`: the KV
        cache's bytes per value (None: the model's). `linear_bytes(n, k)`: what an [n, k]
        decoder linear holds when the checkpoint is quantized (an FP8 one: Fp8Scheme.linear_bytes); None: dtype
        bytes per weight."""
        if spec.moe is not None:
            raise ValueError(f"device='sim' models dense decoders only: {spec.family} is a mixture-of-experts "
                             "model (per-token expert routing is not in the cost model); run it on cpu or cuda")
        if tp > 1:
            from engine.models.tp import local_spec
            spec = local_spec(spec, tp)  # ValueError naming what does not divide
        h, i = spec.hidden_size, spec.intermediate_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        linears = ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i))  # [n, k]: qkv, o, gate/up, down
        qkv = h * (q + 2 * kv)
        layer_params = sum(n * k for n, k in linears)
        layer_bytes = layer_params * dtype_bytes if linear_bytes is None else \
            sum(linear_bytes(n, k) for n, k in linears)
        fused = kernels_per_layer is None and fused_forward.refusal(spec) is None
        if fused:  # the fused layer's plan
            plan = fused_forward.layer_launches(spec)
            kernels, triton, views = plan.aten, plan.triton, plan.views
        elif kernels_per_layer is None:  # the eager layer, as counted
            kernels, triton, views = LAYER_KERNELS + (QK_NORM_KERNELS if spec.qk_norm else 0), LAYER_TRITON, \
                LAYER_VIEWS
        else:  # a fused forward: attention still one Triton launch of them
            kernels, triton, views = kernels_per_layer - 1, 1, 0
        return cls(layers=spec.num_layers, hidden=h, vocab=spec.vocab_size, heads=spec.num_heads,
                   head_dim=spec.head_dim, layer_weight_bytes=layer_bytes,
                   head_weight_bytes=spec.vocab_size * h * dtype_bytes, layer_params=layer_params, qkv_params=qkv,
                   kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
                   * (kv_dtype_bytes or dtype_bytes),
                   dtype_bytes=dtype_bytes, layer_kernels=kernels + (2 if tp > 1 else 0), layer_triton=triton,
                   layer_views=views, tp=tp,
                   sliding_share=sum(map(spec.is_sliding, range(spec.num_layers))) / spec.num_layers,
                   window=spec.sliding_window, fused=fused)

    @property
    def kernels_per_forward(self) -> int:
        return (self.layer_kernels + self.layer_triton) * self.layers + FIXED_KERNELS

    @property
    def weight_bytes(self) -> float:
        """Bytes a decode step reads for weights (the embedding gather reads only its rows)."""
        return self.layers * self.layer_weight_bytes + self.head_weight_bytes


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the cost model needs from a step: per row, its query tokens and its context after the step
    (sequences or numpy arrays; the simulated runner hands over its staging arrays as they are)."""

    query_lens: Sequence[int] | np.ndarray
    seq_lens: Sequence[int] | np.ndarray
    num_sample_rows: int
    # Positions the GEMMs run over when the step is padded to a mixed-step graph's token count (positions of no
    # sequence, engine/cuda_graphs.py); 0: the query tokens alone.
    padded_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return max(int(np.sum(self.query_lens)), self.padded_tokens)


class CostModel:
    """Device times for one model on one profile (seconds)."""

    def __init__(self, spec: ModelSpec, dtype_bytes: int, profile: GpuProfile,
                 kernels_per_layer: int | None = None, tp: int = 1, kv_dtype_bytes: int | None = None,
                 linear_bytes: Callable[[int, int], int] | None = None):
        """tp > 1: one rank of a tensor-parallel group on `profile` GPUs linked as the profile says; every rank
        runs the same step, so a step takes one rank's share plus the collectives. kv_dtype_bytes: the KV
        cache's bytes per value (None: the model dtype's; 1 for fp8), what attention reads and writes.
        linear_bytes: what each decoder linear holds, for a quantized checkpoint (ModelCost.from_spec)."""
        self.profile = profile
        self.model = ModelCost.from_spec(spec, dtype_bytes, kernels_per_layer, tp, kv_dtype_bytes, linear_bytes)
        self.vocab = spec.vocab_size  # rank 0 samples over the whole vocabulary
        p = profile
        self._bw = p.hbm_bytes_per_s * p.bw_fraction
        self._flops = p.bf16_flops * p.flops_fraction

    # ---- forward -----------------------------------------------------------------------------------------
    def forward_s(self, shape: StepShape, graph: bool) -> float:
        return self.gemm_s(shape) + self.attention_s(shape) + self.tp_comm_s(shape) + \
            self.launch_overhead_s(graph) + self.profile.forward_fixed_s

    def tp_comm_s(self, shape: StepShape) -> float:
        """The tensor-parallel collectives of one forward: an all-reduce of the [tokens, hidden] activations
        after the embedding and after every layer's o_proj and down_proj (ring: each rank sends and receives
        2 (N - 1) / N of the bytes), and the sampling rows' vocabulary shards of the fp32 logits gathered to
        rank 0. Not overlapped with compute (a layer's next GEMM needs the sum), as in vLLM's default path."""
        m, p = self.model, self.profile
        if m.tp == 1:
            return 0.0
        n = m.tp
        act = shape.num_tokens * m.hidden * m.dtype_bytes
        allreduce = p.allreduce_latency_s + 2.0 * (n - 1) / n * act / p.link_bytes_per_s
        r = shape.num_sample_rows
        gather = p.allreduce_latency_s + (n - 1) * r * m.vocab * 4 / p.link_bytes_per_s if r else 0.0
        return (2 * m.layers + 1) * allreduce + gather

    def gemm_s(self, shape: StepShape) -> float:
        m, t, r = self.model, shape.num_tokens, shape.num_sample_rows
        head = m.head_weight_bytes if r else 0.0
        nbytes = (m.layers * m.layer_weight_bytes + head + t * m.hidden * m.dtype_bytes * ACT_PASSES_PER_LAYER
                  * m.layers + r * m.vocab * 4)
        # The last layer runs past its attention on the sampled rows only (engine.models.decoder's `keep`).
        last = m.qkv_params * t + (m.layer_params - m.qkv_params) * min(r, t)
        flops = 2.0 * (m.layer_params * (m.layers - 1) * t + last) + 2.0 * m.hidden * m.vocab * r
        return max(nbytes / self._bw, flops / self._flops)

    def attention_s(self, shape: StepShape) -> float:
        m = self.model
        q = np.asarray(shape.query_lens, dtype=np.float64)
        s = np.asarray(shape.seq_lens, dtype=np.float64)
        keys = float(s.sum())
        if not keys:
            return 0.0
        units = float((m.heads * np.ceil(s / ATTN_SPLIT_KEYS) * np.maximum(1.0, np.ceil(q / 64))).sum())
        pairs = float((q * (s - (q - 1) / 2.0)).sum())  # causal within the chunk
        if m.sliding_share:  # sliding layers read at most the window (and a chunk's own keys) per row
            w = np.minimum(s, m.window + q - 1)
            keys = (1 - m.sliding_share) * keys + m.sliding_share * float(w.sum())
            pairs = (1 - m.sliding_share) * pairs + m.sliding_share * float(np.minimum(q * s, q * m.window).sum())
        occupancy = min(1.0, units / self.profile.num_sms)
        nbytes = (keys + float(q.sum())) * m.kv_bytes_per_token
        attn_flops = pairs * 4.0 * m.heads * m.head_dim * m.layers  # QK^T and PV
        return max(nbytes / (self._bw * occupancy), attn_flops / self._flops)

    def launch_overhead_s(self, graph: bool) -> float:
        p, k = self.profile, self.model.kernels_per_forward
        if not graph:
            return k * p.kernel_gap_eager_s
        fused = self.model.fused and p.fused_kernel_gap_graph_s is not None
        return p.graph_launch_s + k * (p.fused_kernel_gap_graph_s if fused else p.kernel_gap_graph_s)

    # ---- host launch cost of the CUDA path -------------------------------------------------------------------
    def host_forward_launch_s(self, graph: bool) -> float:
        """CPU time to launch a forward: one graph replay, or every operator of the eager model (plus, with
        tensor parallelism, rank 0 handing the step to the other ranks)."""
        p, m = self.profile, self.model
        handoff = p.host_tp_broadcast_s if m.tp > 1 else 0.0  # the step's inputs to the other ranks
        if graph:
            return p.host_graph_launch_s + handoff
        per_layer = m.layer_kernels * p.host_op_s + m.layer_views * p.host_view_s + m.layer_triton * p.host_triton_s
        return m.layers * per_layer + FIXED_KERNELS * p.host_op_s + FIXED_VIEWS * p.host_view_s + handoff

    # ---- sampling and copies ------------------------------------------------------------------------------
    def sample_s(self, rows: int, kernels: int, passes: float) -> float:
        """Sampling kernels over [rows, vocab] fp32 logits: a gap per kernel plus `passes` reads of them."""
        if not rows:
            return 0.0
        p = self.profile
        return p.sample_fixed_s + kernels * p.kernel_gap_eager_s + passes * rows * self.vocab * 4 / self._bw

    def copy_s(self, nbytes: float, copies: int = 1) -> float:
        p = self.profile
        return copies * p.copy_latency_s + nbytes / p.pcie_bytes_per_s


def profile(name: str) -> GpuProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"sim_gpu must be one of {', '.join(SIM_GPUS)}; got {name!r}") from None

