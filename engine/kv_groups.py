"""Which KV-cache group each decoder layer's KV lives in: sliding-window layers keep only their window.

A model that mixes sliding-window and full-attention layers (Gemma 2 and 3: five local layers of window 512
to one global in Gemma 3) needs the whole context for its full layers but only the last `window` positions
for its sliding ones. Keeping every layer's KV for the whole context (one block id per position range for all
layers) holds a 3,000-token Gemma 3 request's sliding layers' KV about 3x longer than they need.

The layers are split into KV groups of equal size, vLLM's hybrid KV-cache layout: group 0 holds the full
layers (g of them), groups 1..k hold the sliding layers, g at a time (the last one padded). A *page* is one
block of one group: block_size positions of g layers' K and V. The cache is one tensor
[g, 2, num_pages, block_size, num_kv_heads, head_dim]; layer l reads slot `slot_of[l]` of it, with its group's
block table. Every group draws its pages from one free pool (engine/block_manager.py), so short requests
(every page still in the window) and long ones (mostly full-group pages) share the memory as they need it.

A sequence's logical block i (positions [i * bs, (i + 1) * bs)) holds a page in every group while a query can
still read it; once every later query lies more than `window` positions past it, its sliding groups' pages go
back to the pool (the full group's stays). A model without sliding layers, or with only sliding layers, or
under pipeline parallelism, has one group of every layer: the layout and accounting of before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    layers_per_page: int  # g: the layers of one group, the slots of the cache's first dimension
    num_window_groups: int  # k: groups of sliding layers (0: one group of every layer, no window)
    window: int | None  # the sliding layers' window (HF's convention: a query at p reads keys > p - window)
    layer_group: tuple[int, ...]  # per layer: its group (0 = full attention)
    layer_slot: tuple[int, ...]  # per layer: its slot in the cache's first dimension

    @property
    def num_groups(self) -> int:
        return 1 + self.num_window_groups

    @property
    def pages_per_block(self) -> int:
        """Pages a logical block holds while it is in the window: one per group."""
        return 1 + self.num_window_groups

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one group: every position's KV is kept for the whole context."""
        return cls(num_layers, num_layers, 0, None, (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def of(cls, spec, enabled: bool = True) -> KVLayout:
        """The layout for a model (engine.models.decoder.ModelSpec). Groups only when the model mixes sliding and
        full layers with one window for all sliding ones and `enabled` (EngineConfig's
        disable_hybrid_kv_cache_manager off, no pipeline stages)."""
        n = spec.num_layers
        sliding = [i for i in range(n) if spec.is_sliding(i)]
        full = [i for i in range(n) if not spec.is_sliding(i)]
        if not enabled or not sliding or not full:
            return cls.single(n)
        g = len(full)
        k = -(-len(sliding) // g)
        group, slot = [0] * n, [0] * n
        for j, layer in enumerate(full):
            slot[layer] = j
        for j, layer in enumerate(sliding):
            group[layer], slot[layer] = 1 + j // g, j % g
        return cls(n, g, k, spec.sliding_window, tuple(group), tuple(slot))

    def first_window_block(self, position: int, block_size: int) -> int:
        """The first logical block a query at `position` (or any later one) reads in the sliding groups."""
        return max(0, position - self.window + 1) // block_size

    def window_blocks(self, block_size: int) -> int:
        """Logical blocks a decoding sequence keeps in the sliding groups at most: its window's, plus the
        partial one being written."""
        return -(-(self.window - 1) // block_size) + 1

    def bytes_per_token(self, kv_heads: int, head_dim: int, elem: int) -> dict[str, float]:
        """K and V bytes one position holds in each kind of group (a sliding group's only while in its window)."""
        per_layer = 2 * kv_heads * head_dim * elem
        out = {"full": per_layer * self.layers_per_page}
        if self.num_window_groups:
            out["sliding"] = per_layer * self.layers_per_page * self.num_window_groups
        return out

    def describe(self) -> str:
        if not self.num_window_groups:
            return f"one KV group of {self.num_layers} layers"
        return (f"{self.num_groups} KV groups of {self.layers_per_page} layers: 1 full, {self.num_window_groups} "
                f"sliding (window {self.window})")


def kv_layout(config, spec) -> KVLayout:
    """The layout an engine with EngineConfig `config` uses for model `spec`: groups unless turned off
    (disable_hybrid_kv_cache_manager) or under pipeline parallelism (each stage holds a slice of the layers in one
    cache of its own)."""
    return KVLayout.of(spec, enabled=not config.disable_hybrid_kv_cache_manager
                       and config.pipeline_parallel_size == 1)
