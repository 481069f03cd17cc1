"""bench/pyspy_summary.py: shares of py-spy's raw stacks, by the frame on top and by any frame in the stack."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from pyspy_summary import summarise  # noqa: E402


def test_self_and_inclusive_shares(tmp_path):
    raw = tmp_path / "raw.txt"
    # 3 samples in a -> b, 1 in a -> c -> b (b counted once per stack though it appears twice), 4 in d
    raw.write_text("a;b 3\na;c;b 1\nd 4\n")
    lines = summarise(str(raw), 10, 10).splitlines()
    assert lines[0] == "samples 8"
    own = lines[lines.index("--- self") + 1:lines.index("--- inclusive")]
    anywhere = lines[lines.index("--- inclusive") + 1:]
    assert own == [" 50.0% b", " 50.0% d"]
    assert anywhere == [" 50.0% a", " 50.0% b", " 50.0% d", " 12.5% c"]
