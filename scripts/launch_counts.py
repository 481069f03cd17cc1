"""Print the launches of one bf16 decode step per decoder layer, eager decoder against the fused forward, for the
table in docs/gpu.md: the CUDA code path run on CPU tensors under Triton's interpreter, attention's key split as
an H200 chooses it, counted as tests/test_fused_forward.py counts them (PyTorch operators that launch a kernel plus
Triton launches, views apart). That test holds the fused counts to the plan the simulated device prices and to
issue 46's bounds; this prints the figures, eager ones included.

    python scripts/launch_counts.py [--families llama qwen2 qwen3 gemma3_text]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: the interpreter runs the Triton kernels
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine.attention import triton_paged  # noqa: E402
from test_fused_forward import h200_splits, per_layer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="*", default=["llama", "qwen2", "qwen3", "gemma3_text"])
    args = ap.parse_args()
    triton_paged._auto_splits = h200_splits
    print("| family | eager decoder | fused | of them Triton | views eager / fused |")
    print("| --- | --- | --- | --- | --- |")
    for family in args.families:
        (ek, _, ev), (fk, ft, fv) = per_layer(family, False), per_layer(family, True)
        print(f"| {family} | {ek:g} | {fk:g} | {ft:g} | {ev:g} / {fv:g} |", flush=True)


if __name__ == "__main__":
    main()
