"""Request routing across engine replicas: load ranking with prefix-cache affinity (a Serve RequestRouter).

A request goes to the replica that already caches the longest prefix of its prompt, unless that replica
is more loaded than the least-loaded one by more than `imbalance_threshold`; otherwise replicas are
ranked by load. Prefix knowledge comes from two places: the replicas' own reports (the block hashes their
prefix caches hold, polled through record_routing_stats) and the router's memory of where it sent recent
prompts (immediate, before the next poll).

LoRA adapters: a request's prefix hashes are seeded with its adapter's identity (as the engine's are), so
prefix affinity is per adapter. Without a prefix match, a request for an adapter goes to the least loaded
replica that holds the adapter in a device slot (reported as `lora_adapters`) or was recently sent it, under
the same imbalance threshold, so adapters are not loaded on every replica.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.protocol import GenerateRequest
from engine.block_manager import prefix_hashes

ROUTER_POLICIES = {
    "prefix_aware": "cluster.router:PrefixAwareRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's default
}
DEFAULT_BLOCK_SIZE = 16


_NO_HASHES: list[int] = []  # the prefix report of a replica not polled yet (one object: _reported_set caches by it)


def _report(replica: RunningReplica) -> dict | None:
    """The replica's latest record_routing_stats() report (cluster/replica.py), or None when Serve has not
    polled it yet (a replica that just started: Serve gives an empty dict). A report always carries every
    key, so readers index it: a key renamed on the replica side fails here instead of reading as 0."""
    return replica.routing_stats or None


def router_class(policy: str) -> str:
    """Import path of the router for `policy`; the error lists the valid names."""
    try:
        return ROUTER_POLICIES[policy]
    except KeyError:
        raise ValueError(f"router must be one of {', '.join(ROUTER_POLICIES)}; got {policy!r}") from None


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance_threshold: float = 4.0, kv_weight: float = 8.0,
                         max_prefix_blocks: int = 64, affinity_capacity: int = 200_000, **_: Any) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.kv_weight = kv_weight  # a full KV cache weighs as much as this many queued requests
        self.max_prefix_blocks = max_prefix_blocks
        self.affinity_capacity = affinity_capacity
        self._affinity: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix hash -> replica (LRU)
        self._inflight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._hash_cache: OrderedDict[str, list[int]] = OrderedDict()
        self._reported: dict[ReplicaID, tuple[list, frozenset[int]]] = {}
        self._adapter_sent: OrderedDict[str, ReplicaID] = OrderedDict()  # adapter -> replica last sent it (LRU)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ranked = sorted(candidate_replicas, key=self.load)
        hashes = self._request_hashes(pending_request, candidate_replicas)
        best = self.best_prefix_replica(candidate_replicas, hashes)
        if best is None:
            best = self.best_adapter_replica(candidate_replicas, _adapter_name(pending_request))
        if best is not None and self.load(best) - self.load(ranked[0]) <= self.imbalance_threshold:
            ranked.remove(best)
            ranked.insert(0, best)
        return [[r] for r in ranked]

    def load(self, replica: RunningReplica) -> float:
        report = _report(replica)
        if report is None:  # not polled yet: all the router knows is what it sent there itself
            return self._inflight[replica.replica_id]
        return self._inflight[replica.replica_id] + report["num_waiting"] + self.kv_weight * report["kv_usage"]

    def best_prefix_replica(self, candidates: list[RunningReplica], hashes: list[int]) -> RunningReplica | None:
        """The candidate caching the longest prefix of `hashes` (ties: the less loaded); None if none."""
        best, best_depth = None, 0
        remembered = self._remembered(hashes)
        for replica in candidates:
            depth = max(self._reported_depth(replica, hashes), remembered.get(replica.replica_id, 0))
            if depth > best_depth or (depth == best_depth and depth and self.load(replica) < self.load(best)):
                best, best_depth = replica, depth
        return best

    def best_adapter_replica(self, candidates: list[RunningReplica], adapter: str | None) -> RunningReplica | None:
        """The least loaded candidate holding `adapter` in a device slot (or recently sent it); None if none."""
        if adapter is None:
            return None
        sent = self._adapter_sent.get(adapter)
        holders = [r for r in candidates if r.replica_id == sent
                   or ((report := _report(r)) is not None and adapter in report["lora_adapters"])]
        return min(holders, key=self.load) if holders else None

    def _reported_depth(self, replica: RunningReplica, hashes: list[int]) -> int:
        cached = self._reported_set(replica)
        depth = 0
        for h in hashes:
            if h not in cached:
                break
            depth += 1
        return depth

    def _reported_set(self, replica: RunningReplica) -> frozenset[int]:
        """The replica's reported hashes as a set, rebuilt only when a new report arrives."""
        report = _report(replica)
        report = report["prefix_hashes"] if report is not None else _NO_HASHES
        entry = self._reported.get(replica.replica_id)
        if entry is None or entry[0] is not report:  # holding the list keeps its id from being reused
            entry = (report, frozenset(report))
            self._reported[replica.replica_id] = entry
        return entry[1]

    def _remembered(self, hashes: list[int]) -> dict[ReplicaID, int]:
        """Deepest prefix this router itself sent to each replica."""
        depths: dict[ReplicaID, int] = {}
        for depth, h in enumerate(hashes, start=1):
            replica_id = self._affinity.get(h)
            if replica_id is not None:
                depths[replica_id] = depth
        return depths

    def _request_hashes(self, pending: PendingRequest | None, candidates: list[RunningReplica]) -> list[int]:
        request = _generate_request(pending)
        if request is None:
            return []
        cached = self._hash_cache.get(request.request_id)
        if cached is None:
            block_size = next((report["block_size"] for r in candidates if (report := _report(r)) is not None),
                              DEFAULT_BLOCK_SIZE)  # no replica polled yet: the engine's default
            root = request.lora_request.hash_root if request.lora_request is not None else 0
            cached = prefix_hashes(request.prompt_token_ids, block_size, self.max_prefix_blocks, root)
            self._hash_cache[request.request_id] = cached
            while len(self._hash_cache) > 1024:
                self._hash_cache.popitem(last=False)
        return cached

    # ---- hooks Serve calls -------------------------------------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._inflight[replica_id] += 1
        request = _generate_request(pending_request)
        if request is None:
            return
        if request.lora_request is not None:
            self._adapter_sent[request.lora_request.lora_name] = replica_id
            self._adapter_sent.move_to_end(request.lora_request.lora_name)
            while len(self._adapter_sent) > 4096:
                self._adapter_sent.popitem(last=False)
        for h in self._hash_cache.pop(request.request_id, []):
            self._affinity[h] = replica_id
            self._affinity.move_to_end(h)
        while len(self._affinity) > self.affinity_capacity:
            self._affinity.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight[replica_id] = max(0, self._inflight[replica_id] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        self._reported.pop(replica_id, None)
        for h in [h for h, r in self._affinity.items() if r == replica_id]:
            del self._affinity[h]
        for name in [n for n, r in self._adapter_sent.items() if r == replica_id]:
            del self._adapter_sent[name]


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerateRequest):
            return arg
    return None


def _adapter_name(pending: PendingRequest | None) -> str | None:
    request = _generate_request(pending)
    return request.lora_request.lora_name if request is not None and request.lora_request is not None else None
