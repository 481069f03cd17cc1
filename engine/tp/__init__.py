"""Tensor parallelism: every layer sharded over N ranks (engine/models/tp.py), rank 0 the engine's own runner,
ranks 1..N-1 worker processes following its steps. See engine/tp/runner.py."""

from engine.tp.engine import TensorParallelEngine, tensor_parallel_runner
from engine.tp.runner import TensorParallelError, TPModelRunner
from engine.tp.worker import TPWorker, TPWorkerSpec

__all__ = ["TPModelRunner", "TPWorker", "TPWorkerSpec", "TensorParallelEngine", "TensorParallelError",
           "tensor_parallel_runner"]
