"""Device slots for adapters: which adapter each of `max_loras` slots holds, LRU over the idle ones.

Pure CPU Python (the scheduler's side). Slot 0 means "no adapter"; slots 1..max_loras hold one adapter each.
A running sequence holds a reference on its adapter's slot from admission (or swap-in) until it is released
or preempted, so an adapter in use is never evicted; a sequence whose adapter finds no slot (all held)
waits in the queue. Loading an adapter into a slot is an op that travels with the next launched step
(like the scheduler's SwapOps): the runner copies the weights in stream order before that step's forward,
after every earlier forward that read the slot's previous adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(slots=True)
class LoadOp:
    """Copy `adapter` (engine.lora.adapter.LoRAAdapter) into device slot `slot`."""

    slot: int
    adapter: object


class AdapterSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.keys: list[int | None] = [None] * (max_loras + 1)  # slot -> adapter key (slot 0 unused)
        self.names: list[str | None] = [None] * (max_loras + 1)
        self.refs = [0] * (max_loras + 1)
        self.by_key: dict[int, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded slots with no reference, LRU first
        self.loads: list[LoadOp] = []  # decided, not yet handed to a step
        self.num_loads = 0
        self.num_evictions = 0

    def acquire(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot, loading it into a free or least-recently-used idle slot if needed.
        True for a sequence without adapter; False (nothing changed) when every slot is held."""
        adapter = seq.lora
        if adapter is None or seq.lora_slot:
            return True
        slot = self.by_key.get(adapter.key)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return False
            self.keys[slot], self.names[slot] = adapter.key, adapter.name
            self.by_key[adapter.key] = slot
            self.loads.append(LoadOp(slot, adapter))
            self.num_loads += 1
        if self.refs[slot] == 0:
            self.idle.pop(slot, None)
        self.refs[slot] += 1
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s reference (idempotent); a slot nobody holds becomes the most recent idle one."""
        slot = seq.lora_slot
        if not slot:
            return
        seq.lora_slot = 0
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.idle[slot] = None

    def take_loads(self) -> list[LoadOp]:
        loads, self.loads = self.loads, []
        return loads

    def resident(self) -> list[str]:
        """Names of the adapters in device slots (the router prefers replicas holding a request's adapter)."""
        return [n for n in self.names[1:] if n is not None]

    def _take_slot(self) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if self.keys[slot] is None:
                return slot
        if not self.idle:
            return None
        slot, _ = self.idle.popitem(last=False)
        del self.by_key[self.keys[slot]]
        self.keys[slot] = self.names[slot] = None
        self.num_evictions += 1
        return slot

    def check_integrity(self, live: Iterable[Sequence]) -> None:
        expected = [0] * (self.max_loras + 1)
        for seq in live:
            if seq.lora_slot:
                expected[seq.lora_slot] += 1
        if expected != self.refs:
            raise AssertionError(f"adapter slot refs {self.refs} disagree with the sequences' {expected}")
        idle = {s for s in range(1, self.max_loras + 1) if self.keys[s] is not None and self.refs[s] == 0}
        if set(self.idle) != idle:
            raise AssertionError("the idle LRU does not hold exactly the loaded slots nobody references")
