"""A tensor-parallel rank other than 0, as its own process (cluster/tensor_parallel.py runs it as a Ray actor).

No Ray here: the worker joins rank 0's process group, builds its shard of the model and KV cache (in lock step
with rank 0's memory profile), then `follow` runs the steps rank 0 broadcasts until it is told to stop.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models import load_hf_config, model_spec
from engine.tp.comm import GroupComm
from engine.tp.runner import TPModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TPWorkerSpec:
    """What a worker rank needs to start (picklable: it travels to the worker actor)."""

    config: EngineConfig
    rank: int
    size: int
    dtype: str  # the engine's resolved torch dtype name, e.g. "float32"
    max_model_len: int
    store_host: str = "127.0.0.1"  # rank 0's rendezvous store (engine/tp/comm.py)
    store_port: int = 0
    bind_host: str | None = "127.0.0.1"  # the address this rank's gloo device binds (its node's IP across nodes)
    num_threads: int | None = None  # intra-op threads of this rank's forward (None: torch's default)


class TPWorker:
    def __init__(self, spec: TPWorkerSpec):
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        comm = GroupComm.join(spec.store_host, spec.store_port, spec.rank, spec.size, spec.bind_host,
                              spec.config.stall_timeout_s)
        hf_config = load_hf_config(spec.config.model_dir)  # a GGUF file's is the directory written for it
        self.runner = TPModelRunner(spec.config, hf_config, model_spec(hf_config), torch.device("cpu"),
                                    getattr(torch, spec.dtype), spec.max_model_len, comm)

    def ready(self) -> int:
        """The KV blocks this rank holds (the group's agreed count)."""
        return self.runner.num_kv_blocks

    def follow(self, exit_on_error: bool = True) -> int:
        """Run rank 0's steps until it stops the group. On an error the process exits: its closed sockets
        are what tells the other ranks (blocked in a collective) that this one is gone, at once."""
        try:
            return self.runner.follow()
        except BaseException:
            logger.exception("tensor-parallel rank %d failed", self.spec.rank)
            if exit_on_error:
                os._exit(1)
            raise
