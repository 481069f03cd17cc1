"""Engine configuration: one frozen object, validated where it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda", "sim")
SCHEDULER_POLICIES = ("fifo", "prefill_first")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")  # engine.attention checks they can run


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to start; docs/architecture.md and docs/engine.md describe them."""

    # A checkpoint directory, or a GGUF file (served with its Q8_0 / Q4_1 weights quantized, on CPU:
    # engine/models/gguf_loader.py); `model_dir` is the directory the engine reads config and tokenizer from.
    model: str = str(DEFAULT_MODEL_DIR)
    # With a GGUF model (vLLM's name): a directory with the tokenizer files to use (the base model's); None
    # takes the tokenizer transformers converts from the GGUF file.
    tokenizer: str | None = None
    dtype: str = "auto"
    # The paged KV cache's dtype (vLLM's names): "auto" (the model's), "bfloat16" (on CPU with a float32 model:
    # half the bytes per block, so twice the blocks), "fp8" / "fp8_e4m3" (e4m3 with per-layer scales of 1.0
    # unless calibrated; cuda and sim only). engine/kv_dtype.py resolves it; docs/engine.md#kv-cache-dtype.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    num_cpu_blocks: int = 0
    # Host KV pool for preempted sequences in GiB, the alternative to num_cpu_blocks (vLLM's swap_space).
    swap_space_gb: float = 0.0
    max_num_seqs: int = 256
    # Tokens one step may carry (chunked prefill splits longer prompts). None (auto): 2048 on a GPU or the
    # simulated one; on CPU 512 per forward thread, within 512..2048 (token_budget()). A CPU step of 2048
    # prompt tokens is slow on a few cores, and a burst of prompts arrives in such steps while every running
    # stream waits; smaller steps let the prompts of a burst share steps with the streams already decoding,
    # which lowers TTFT for little time per token. Chosen by measurement: docs/engine.md#scheduler.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's name: True keeps every layer's KV for the whole context. False (default): a model mixing sliding-window
    # and full-attention layers (Gemma 2 and 3) gives its sliding layers' blocks back once they leave the window
    # (engine/kv_groups.py); models without sliding layers are laid out as before either way.
    disable_hybrid_kv_cache_manager: bool = False
    scheduler: str = "fifo"
    # 2: the next step's forward is launched before the previous step commits (Photon's ping-pong slots); 1: the
    # blocking loop. None (auto): 2 where the forward runs beside the loop (CUDA streams, a CPU forward thread,
    # pipeline stages, the simulated device), 1 where it runs inline on the loop thread (CPU with no core
    # spare, see cpu_executor_thread): there the forward of t+1 cannot overlap the commit of t, and deferring
    # that commit only delays every token by a step (docs/engine.md#on-cpu-inline-forward-or-a-worker-thread).
    # 3: three slots, so two launched steps wait on the device while the loop commits the oldest: a loop tick
    # slower than a device step borrows from faster ones instead of idling the device (the loop's mean host work
    # must still fit under a step). Under host-bound load each token reaches its stream a tick later, and a
    # finished request rides in up to two more steps. While a request whose sampling reads its commits on the host
    # runs (a grammar, allowed_token_ids or min_tokens) the loop keeps to two slots; penalties count an uncommitted
    # token on the device. One device only (no pipeline or tensor parallelism). docs/engine.md#three-slots.
    pipeline_depth: int | None = None
    # vLLM's stream_interval: a streamed request's output is emitted once it holds this many new tokens (its
    # first token and its last are always emitted at once). 1: every commit. Larger values cut the per-event
    # host work of everything downstream (Serve's replica, ingress and proxy each handle every event) at the
    # cost of burstier streams; the tokens and text are the same.
    stream_interval: int = 1
    cuda_graphs: bool = True
    # With cuda_graphs: steps that carry prompt chunks replay graphs too, padded to token-count buckets
    # (engine/cuda_graphs.py), where the attention backend allows it (triton) and the model is not a
    # mixture-of-experts one; False runs them eagerly (one launch per kernel, from Python).
    cuda_graphs_mixed: bool = True
    seed: int = 0
    # "auto" (flash_attn / triton / torch on cuda, torch on cpu) or a name in engine/attention's registry.
    attention_backend: str = "auto"
    # The fused forward (engine/models/fused_forward.py: eight kernel launches a decoder layer instead of ~40).
    # None (auto): on cuda with the triton attention backend, for every family but mixture-of-experts ones;
    # False: the eager layers; True: required (an error says why it cannot run; on cpu it needs
    # TRITON_INTERPRET=1 and attention_backend="triton", which only tests want).
    fused_forward: bool | None = None
    # Fraction of KV blocks kept free before new prefills are held back (HF's safety margin).
    admission_margin: float = 0.05
    # KV pool size when num_kv_blocks is None: a fraction of device memory (cuda); on cpu a fixed byte budget
    # (cpu_kv_cache_bytes) or, when that is None, cpu_memory_utilization x the host memory available at start
    # (MemAvailable, after the weights are loaded), less the profiled activation peak (engine/memory.py).
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int | None = None
    cpu_memory_utilization: float = 0.5
    # CPU forwards on a dedicated thread, so the engine loop's host work overlaps them (torch ops release the
    # GIL). None (auto): only when a core is left for that host work beyond the forward's intra-op threads.
    # On a machine whose cores all run the forward's OpenMP team, host work beside it stalls the team at
    # every parallel region, so there the thread costs more than it overlaps
    # (docs/engine.md#on-cpu-inline-forward-or-a-worker-thread).
    cpu_executor_thread: bool | None = None
    # Intra-op threads for CPU forwards (torch.set_num_threads in the engine's process); None = the process's
    # default. Under Ray that default is OMP_NUM_THREADS, which Ray sets to the actor's CPU reservation (1 for
    # a Serve replica's fractional num_cpus); an app's only CPU engine replica takes every core of its node
    # instead (cluster/replica.py), and with several replicas on a node this splits its cores between them.
    cpu_threads: int | None = None
    # CPU linears with weights packed at load (engine/cpu/linear.py: Tandem's GEMM for fp32 on AVX-512,
    # oneDNN otherwise); off = F.linear.
    cpu_onednn: bool = True
    # Pipeline parallelism (engine/pipeline, cluster/pipeline.py): the layers split over this many stage
    # actors; 1 = the single-device engine. The pp_* switches turn SiPipe's three techniques off for the
    # ablation benchmark: CPU sampling on the driver, token-safe execution (two input-buffer versions per
    # stage, prepared before the hidden states arrive), structure-aware hidden-state transmission.
    # pp_cpu_sampling None (auto): the driver samples CPU stages' logits, GPU stages sample on the last one
    # (fp32 logits rows are not shipped off the GPU); either way every sampling feature works.
    pipeline_parallel_size: int = 1
    pp_cpu_sampling: bool | None = None
    pp_token_safe: bool = True
    pp_structure_aware: bool = True
    pp_stage_num_cpus: float = 1.0  # logical CPUs each stage actor reserves (plus one GPU on cuda)
    # Tensor parallelism (engine/tp, cluster/tensor_parallel.py): every layer sharded Megatron-style over this
    # many ranks, rank 0 in the engine's process and ranks 1.. as worker actors; 1 = the single-device engine.
    # With pipeline_parallel_size > 1, each stage's layers are sharded over that many ranks (engine/tp/stage.py).
    # Whether the model's heads and sizes divide is checked when the engine reads the model (engine/models/tp.py).
    tensor_parallel_size: int = 1
    tp_worker_num_cpus: float = 1.0  # logical CPUs each worker actor reserves (and its intra-op threads on cpu)
    # Serving robustness. A grammar that has not compiled after this long fails its request (a ValueError
    # naming structured_outputs: a 400 over HTTP); the engine is unhealthy once its loop has made no
    # progress for stall_timeout_s while it had work (a hung step), so Serve replaces the replica.
    grammar_compile_timeout_s: float = 10.0
    stall_timeout_s: float = 120.0
    # device="sim": a simulated accelerator (engine/sim): the host side is real, the device's time is modelled
    # for the GPU profile `sim_gpu`; the model directory needs only config.json and tokenizer files.
    # sim_eos_rate: the chance that a generated token is EOS (0: never, unless a grammar's stop token is all that
    # is allowed).
    sim_gpu: str = "h100"
    sim_eos_rate: float = 0.0
    # Speculative decoding on the simulated device: the chance that a draft token is the token the target would
    # have produced there (the acceptance rate alpha; drafts count up to the first that is not). Its own tokens are
    # hashes, so a draft otherwise almost never matches; None lets those hashes decide. It models acceptance for
    # timing: outputs then differ from the non-speculative ones.
    sim_spec_acceptance: float | None = None
    # Kernels one decoder layer launches on the simulated device: None = this engine's decoder as counted
    # (engine/sim/cost_model.py), e.g. 10 to price a fused forward such as vLLM's.
    sim_kernels_per_layer: int | None = None
    # Multi-LoRA (engine/lora): PEFT adapters named by `lora_modules` ({name: directory}) or found by name as
    # subdirectories of `lora_dir`; either one turns enable_lora on. Up to `max_loras` adapters sit in device
    # slots at once (LRU over the idle ones), of rank up to `max_lora_rank`.
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    lora_dir: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    # Speculative decoding (engine/spec_decode.py), vLLM's names: {"method": "ngram", "num_speculative_tokens": K,
    # "prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}, or a draft model:
    # {"model": DIR, "num_speculative_tokens": K} ("method": "draft_model" optional). None: off.
    speculative_config: dict | None = None
    # The model's sampling defaults (engine/generation_config.py), vLLM's names and meanings: "auto" applies the
    # temperature / top_p / top_k / min_p / repetition_penalty of the model's generation_config.json to requests
    # that leave them unset, and its max_new_tokens as a cap on max_tokens; "vllm" applies none; a directory
    # reads its generation_config.json instead. override_generation_config: keys merged over those, e.g.
    # {"temperature": 0.5}.
    generation_config: str = "auto"
    override_generation_config: dict | None = None

    def __post_init__(self) -> None:
        model = str(self.model) if self.model is not None else str(DEFAULT_MODEL_DIR)
        object.__setattr__(self, "model", model)
        _choice("dtype", self.dtype, _DTYPES)
        _choice("device", self.device, _DEVICES)
        from engine import kv_dtype

        # fp8 under device "auto": checked when the engine resolves it
        kv_dtype.check_name(self.kv_cache_dtype, self.device, self.attention_backend)
        _choice("scheduler", self.scheduler, SCHEDULER_POLICIES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("stream_interval", self.stream_interval)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        if self.pipeline_depth not in (None, 1, 2, 3) or isinstance(self.pipeline_depth, bool):
            raise ValueError(f"pipeline_depth must be 1, 2, 3 or None (auto), got {self.pipeline_depth!r}")
        if self.pipeline_depth == 3 and (self.pipeline_parallel_size > 1 or self.tensor_parallel_size > 1):
            raise ValueError("pipeline_depth=3 runs on one device: not with pipeline_parallel_size or "
                             "tensor_parallel_size > 1")
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if isinstance(self.pp_stage_num_cpus, bool) or not isinstance(self.pp_stage_num_cpus, (int, float)) \
                or self.pp_stage_num_cpus < 0:
            raise ValueError(f"pp_stage_num_cpus must be a number >= 0, got {self.pp_stage_num_cpus!r}")
        if self.pipeline_parallel_size > 1 and (self.num_cpu_blocks or self.swap_space_gb):
            raise ValueError("num_cpu_blocks/swap_space_gb (KV offload) is not supported with "
                             "pipeline_parallel_size > 1: preempted requests are soft-reset instead")
        self._check_tensor_parallel()
        if self.cpu_threads is not None:
            _positive("cpu_threads", self.cpu_threads)
        if self.fused_forward not in (None, True, False):
            raise ValueError(f"fused_forward must be a boolean or None (auto), got {self.fused_forward!r}")
        if self.cpu_executor_thread not in (None, True, False):
            raise ValueError(f"cpu_executor_thread must be a boolean or None (auto), got {self.cpu_executor_thread!r}")
        if self.pp_cpu_sampling not in (None, True, False):
            raise ValueError(f"pp_cpu_sampling must be a boolean or None (auto), got {self.pp_cpu_sampling!r}")
        for name in ("enable_prefix_caching", "cuda_graphs", "cuda_graphs_mixed", "cpu_onednn", "pp_token_safe",
                     "pp_structure_aware", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if self.cpu_kv_cache_bytes is not None:
            _positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        from engine.sim.cost_model import SIM_GPUS

        _choice("sim_gpu", self.sim_gpu, SIM_GPUS)
        if isinstance(self.sim_eos_rate, bool) or not isinstance(self.sim_eos_rate, (int, float)) \
                or not 0.0 <= self.sim_eos_rate <= 1.0:
            raise ValueError(f"sim_eos_rate must be a number in [0, 1], got {self.sim_eos_rate!r}")
        if self.sim_kernels_per_layer is not None:
            _positive("sim_kernels_per_layer", self.sim_kernels_per_layer)
        if self.device == "sim" and self.pipeline_parallel_size > 1:
            raise ValueError("device='sim' runs a single simulated device; pipeline_parallel_size must be 1")
        for name in ("grammar_compile_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        for name in ("admission_margin", "gpu_memory_utilization", "cpu_memory_utilization", "swap_space_gb"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not 0.0 <= self.admission_margin < 1.0:
            raise ValueError(f"admission_margin must be in [0, 1), got {self.admission_margin!r}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb!r}")
        if self.swap_space_gb and self.num_cpu_blocks:
            raise ValueError("give either num_cpu_blocks or swap_space_gb (the host KV pool size), not both")
        for name in ("gpu_memory_utilization", "cpu_memory_utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        self._check_lora()
        self._check_speculative()
        if self.gguf_file is not None:
            self._check_gguf()
        elif self.tokenizer is not None:
            raise ValueError("tokenizer is for a GGUF model (model='FILE.gguf'); a checkpoint directory's own "
                             "tokenizer files are used")
        elif not os.path.isdir(model):
            raise ValueError(f"model must be a local checkpoint directory (config.json, *.safetensors, "
                             f"tokenizer files) or a .gguf file; {model!r} is not a directory")
        elif (scheme := self._quant_scheme()) is not None:
            self._check_quantized_checkpoint(scheme)
        if not isinstance(self.generation_config, str):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict, got {self.override_generation_config!r}")
        self.sampling_defaults()  # a bad file or override fails here, naming itself

    def sampling_defaults(self) -> dict:
        """SamplingParams field -> the model's default for requests that leave it unset ("max_tokens": the cap on
        every request's); engine/generation_config.py."""
        from engine.generation_config import sampling_defaults

        return sampling_defaults(self.model_dir, self.generation_config, self.override_generation_config)

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file `model` names, absolute; None for a checkpoint directory."""
        return os.path.abspath(self.model) if self.model.lower().endswith(".gguf") else None

    @property
    def model_dir(self) -> str:
        """Where config.json and the tokenizer files are: `model`, or for a GGUF file the directory
        engine/models/gguf_loader.py writes for it once (config from the file's metadata, the tokenizer's files)."""
        if self.gguf_file is None:
            return self.model
        from engine.models.gguf_loader import gguf_model_dir

        return gguf_model_dir(self.gguf_file, self.tokenizer and os.path.abspath(self.tokenizer))

    def _check_gguf(self) -> None:
        """A GGUF model: a file; CPU, fp32 activations (what its kernels cover); pipeline stages and adapters;
        tensor parallelism where its row-parallel weights split on block boundaries."""
        if not os.path.isfile(self.model):
            raise ValueError(f"model {self.model!r} names a GGUF file that does not exist")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a directory of tokenizer files; {self.tokenizer!r} is not one")
        self._check_quantized(f"a GGUF model (model={self.model!r})")
        self.model_dir  # noqa: B018 - written now (or found): a bad file fails here, naming itself
        if self.tensor_parallel_size > 1:  # K splits on block boundaries (heads are checked with the model's spec)
            from engine.models.gguf_loader import check_tensor_parallel

            check_tensor_parallel(self.gguf_file, self.tensor_parallel_size)

    def _quant_scheme(self):
        """The quantization scheme of the checkpoint directory (engine/models/quantized_checkpoint.py: GPTQ / AWQ
        int4, FP8), None when it is not quantized; ValueError naming a quantization_config Tandem does not run."""
        from engine.models.quantized_checkpoint import checkpoint_scheme

        return checkpoint_scheme(self.model)

    def _check_quantized_checkpoint(self, scheme) -> None:
        """int4 runs on CPU as GGUF does, or on CUDA and sim (_check_quantized); FP8 runs on cpu, cuda and sim in any
        dtype, with LoRA, pipeline stages and tensor parallelism. Both shard for tensor parallelism (their K splits
        are checked as the ranks load: int4's on Q4_1 block boundaries, FP8's anywhere)."""
        from engine.models.int4_loader import Int4Scheme

        if isinstance(scheme, Int4Scheme):
            self._check_quantized(f"a {scheme.method} int4 checkpoint (model={self.model!r})", cuda=True)

    def _check_quantized(self, what: str, cuda: bool = False) -> None:
        """Quantized weights: GGUF on CPU; GPTQ/AWQ int4 (`cuda`) on CPU, on CUDA (the Triton int4 GEMM,
        engine/models/int4_triton.py) or on the simulated device (priced at that GEMM's bytes). On CPU fp32
        activations, with pipeline stages, LoRA adapters and tensor-parallel shards over the CPU's quantized
        linears. The Triton int4 GEMM (on CUDA, and with fused_forward under the interpreter) takes no adapters,
        nor stages on CUDA: untested there."""
        on_cuda = cuda and (self.device == "cuda" or (self.device == "auto" and _cuda_available()))
        on_gpu = on_cuda or (cuda and self.device == "sim")  # the model's dtype, an fp8 KV cache
        triton = on_cuda or (cuda and self.fused_forward is True)
        devices, where = (("auto", "cpu", "cuda", "sim"), "int4 weights run on cpu, cuda or sim") if cuda else \
            (("auto", "cpu"), "quantized weights run on CPU; device='cpu' or 'auto' without CUDA")
        unsupported = [why for why, used in (
            (f"device={self.device!r} ({where})", self.device not in devices),
            (f"dtype={self.dtype!r} (on CPU its quantized linears take float32 activations: 'auto' or 'float32')",
             not on_gpu and self.dtype not in ("auto", "float32")),
            ("pipeline_parallel_size > 1 on cuda (the Triton int4 GEMM's stages are untested)",
             on_cuda and self.pipeline_parallel_size > 1),
            ("LoRA adapters (enable_lora, lora_modules, lora_dir) over the Triton int4 GEMM (cuda or fused_forward)",
             triton and self.enable_lora),
            (f"kv_cache_dtype={self.kv_cache_dtype!r} (an fp8 KV cache runs on cuda)",
             not on_gpu and self.kv_cache_dtype.startswith("fp8")),
        ) if used]
        if unsupported:
            raise ValueError(f"{what} is not supported with {'; '.join(unsupported)}")

    def token_budget(self) -> int:
        """max_num_batched_tokens, resolved: as given, else 2048 on cuda and sim, and on CPU 512 tokens per
        forward thread (cpu_threads, else torch's intra-op threads) within 512..2048."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        import torch

        if self.device in ("cuda", "sim") or (self.device == "auto" and torch.cuda.is_available()):
            return 2048
        return max(512, min(2048, 512 * (self.cpu_threads or torch.get_num_threads())))

    def _check_tensor_parallel(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        cpus = self.tp_worker_num_cpus
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
            raise ValueError(f"tp_worker_num_cpus must be a number >= 0, got {cpus!r}")
        if self.tensor_parallel_size == 1:
            return
        unsupported = [why for why, used in (
            ("device='cuda' (NCCL is not wired yet)", self.device == "cuda"),
            ("num_cpu_blocks/swap_space_gb (KV offload; preempted requests are soft-reset instead)",
             bool(self.num_cpu_blocks or self.swap_space_gb)),
            ("LoRA adapters (enable_lora, lora_modules, lora_dir)",
             bool(self.enable_lora or self.lora_modules or self.lora_dir))) if used]
        if unsupported:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is not supported with "
                             f"{'; '.join(unsupported)}")

    def speculative(self):
        """speculative_config as an engine.spec_decode.SpeculativeConfig (None when off)."""
        from engine.spec_decode import SpeculativeConfig

        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def _check_speculative(self) -> None:
        a = self.sim_spec_acceptance
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
            raise ValueError(f"sim_spec_acceptance must be a number in [0, 1] or None, got {a!r}")
        if self.speculative_config is None:
            return
        spec = self.speculative()  # raises ValueError naming a bad field
        where = [name for name, on in (("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1),
                                       ("tensor_parallel_size > 1", self.tensor_parallel_size > 1)) if on]
        if where:
            raise ValueError(f"speculative_config is not supported with {', '.join(where)} yet")
        if spec.method == "draft_model" and self.device == "sim":
            raise ValueError("speculative_config with a draft model is not supported on the simulated device "
                             "(device='sim', whose tokens are hashes); use the ngram method with "
                             "sim_spec_acceptance to model acceptance")

    def _check_lora(self) -> None:
        """LoRA fields; enable_lora is implied by an adapter source."""
        from engine.lora.request import MAX_LORA_RANK

        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items()):
                raise ValueError(f"lora_modules must map adapter names to directories, got {self.lora_modules!r}")
            bad = [k for k in self.lora_modules if ":" in k]
            if bad:
                raise ValueError(f"lora_modules names must not contain ':' (BASE:ADAPTER); got {bad}")
        if self.lora_dir is not None and not os.path.isdir(str(self.lora_dir)):
            raise ValueError(f"lora_dir must be a directory of PEFT adapters; {self.lora_dir!r} is not one")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a boolean, got {self.enable_lora!r}")
        if self.lora_modules or self.lora_dir:
            object.__setattr__(self, "enable_lora", True)
        # absolute: engine replicas may run in another working directory than the one that built the config
        if self.lora_modules:
            object.__setattr__(self, "lora_modules", {k: os.path.abspath(v) for k, v in self.lora_modules.items()})
        if self.lora_dir is not None:
            object.__setattr__(self, "lora_dir", os.path.abspath(str(self.lora_dir)))
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError("LoRA adapters (enable_lora, lora_modules, lora_dir) are not supported with "
                             "pipeline_parallel_size > 1")
        if self.enable_lora and self.device == "sim":
            raise ValueError("LoRA adapters (enable_lora, lora_modules, lora_dir) are not supported on "
                             "device='sim'")


def _choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _cuda_available() -> bool:
    """Whether device 'auto' resolves to cuda (engine/core.py's rule), for checks that differ by device."""
    import torch

    return torch.cuda.is_available()
