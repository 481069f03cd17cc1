"""What every attention backend reads for one forward: the paged layout of the step's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Token layout of one step (flattened, sequences back to back).

    Tensors live on the model's device. The host lists mirror them for the CPU path, which loops over
    prefill chunks in Python; GPU backends must read only the tensors (no host sync in the hot path).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; -1 = skip (padding)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: positions attended, the chunk included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0 (a valid id, masked out)
    block_size: int
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # Filled by the backend's prepare(): whatever it precomputes once per step and reuses for every layer.
    backend_data: object = None
    # Sliding-window KV groups (engine/kv_groups.py): per group, this step's metadata for the layers in it (its
    # block tables and slots; [0] is this one); None with one group.
    groups: list | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        return self if self.groups is None else self.groups[group]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One decoder layer's attention settings, passed with every backend call (models such as Gemma alternate
    sliding-window and global layers and cap the scores): keys within `sliding_window` positions of the
    query (HF's convention: key > query - window; None = the whole context) and tanh soft-capping of the
    scaled scores, cap * tanh(score / cap), before the mask and softmax (None = off)."""

    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None; got {self.sliding_window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be > 0 or None; got {self.softcap}")
