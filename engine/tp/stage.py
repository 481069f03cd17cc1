"""Tensor parallelism inside a pipeline stage (TP x PP): each stage's layers sharded over its own TP group.

A stage's rank 0 is the pipeline's StageWorker (engine/pipeline/stage.py) that the stage transport drives;
its other ranks are StageWorkers of the same stage started with `follow()`. At each forward, rank 0 sends
its ranks the prepared step (engine/tp/channel.py) and, past the first stage, the hidden states it received
from upstream; every rank runs the stage's sharded layers (engine/models/tp.py) and only rank 0 passes the
result on (the hidden states are equal on every rank after the row-parallel all-reduce; the last stage's
logits are gathered to rank 0). Each stage's group has its own process group and rendezvous store (opened by
the pipeline driver), so the stages' collectives never mix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.models.decoder import ModelSpec
from engine.models.tp import TPShard
from engine.tp.channel import StepChannel
from engine.tp.comm import GroupComm


@dataclass(frozen=True, slots=True)
class StageTPSpec:
    """Where one rank of a stage's TP group meets the others (picklable, inside the StageSpec)."""

    rank: int
    size: int
    store_host: str
    store_port: int
    bind_host: str = "127.0.0.1"
    timeout_s: float = 120.0


def stage_rank_specs(spec, store_host: str, store_port: int, bind_host: str, timeout_s: float) -> list:
    """The StageSpec of every TP rank of stage `spec` (rank 0 first)."""
    return [dataclasses.replace(spec, tp=StageTPSpec(r, spec.tensor_parallel_size, store_host, store_port,
                                                     bind_host, timeout_s))
            for r in range(spec.tensor_parallel_size)]


class StageTP:
    """One rank's side of its stage's TP group."""

    def __init__(self, tp: StageTPSpec, full: ModelSpec):
        self.comm = GroupComm.join(tp.store_host, tp.store_port, tp.rank, tp.size, tp.bind_host, tp.timeout_s)
        self.shard = TPShard(tp.rank, tp.size, full, self.comm)
        self.channel = StepChannel(self.comm)

    def agree(self, num_kv_blocks: int) -> int:
        """The smallest KV capacity over the stage's ranks; the ranks are built from here on."""
        blocks = self.comm.all_reduce_min(num_kv_blocks)
        self.comm.started()
        return blocks

    def send(self, bufs, hidden: torch.Tensor | None) -> None:
        """Rank 0: the prepared step, then the upstream hidden states [T, hidden] if any."""
        self.channel.send(bufs, extra=int(hidden is not None))
        if hidden is not None:
            self.comm.broadcast(hidden.contiguous())

    def receive(self, bufs, tables: torch.Tensor, hidden_buf: torch.Tensor | None):
        """Another rank: (False, None) on STOP, else (True, the step's hidden states or None)."""
        has_hidden = self.channel.receive(bufs, tables)
        if has_hidden is None:
            return False, None
        if not has_hidden:
            return True, None
        hidden = hidden_buf[:bufs.num_tokens]
        self.comm.broadcast(hidden)
        return True, hidden
