#!/usr/bin/env python3
"""Summarise a `py-spy record -f raw` file: each frame's share of the samples on top of the stack (self) and
anywhere in it (inclusive), highest first.

    py-spy record -p PID -d 10 -r 100 -f raw -o replica.txt --nonblocking
    python bench/pyspy_summary.py replica.txt [--self 20] [--inclusive 60]
"""

from __future__ import annotations

import argparse
import collections


def summarise(path: str, n_self: int, n_inclusive: int) -> str:
    own, anywhere, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            for frame in dict.fromkeys(frames):  # each frame once per stack, in stack order (stable ties)
                anywhere[frame] += n
    out = [f"samples {total}", "--- self"]
    out += [f"{100 * n / total:5.1f}% {frame[:150]}" for frame, n in own.most_common(n_self)]
    out.append("--- inclusive")
    out += [f"{100 * n / total:5.1f}% {frame[:150]}" for frame, n in anywhere.most_common(n_inclusive)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy's raw (collapsed stacks) output")
    ap.add_argument("--self", dest="n_self", type=int, default=20, help="frames listed by self share")
    ap.add_argument("--inclusive", type=int, default=60, help="frames listed by inclusive share")
    args = ap.parse_args()
    print(summarise(args.raw, args.n_self, args.inclusive))


if __name__ == "__main__":
    main()
