"""The CPU kernels' build cache survives an interrupted build (engine/cpu/kernels.py `_load_locked`).

torch's cpp_extension takes a `lock` file in the build directory on every load, and only the process that made
it removes it: a build killed midway (Ctrl-C during the first compile) left it, and every later load of that
build waited on it forever. CI hung that way once a run was cancelled during the compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from torch.utils.file_baton import FileBaton

from engine.cpu import kernels

ROOT = Path(__file__).resolve().parents[1]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """A copy of this CPU's built kernels in a cache of its own, with the `lock` file a killed build leaves: a new
    process loads the kernels (torch finds them built) and removes the stale lock. Before the fix it waited on it
    until the timeout."""
    built = kernels.load()
    assert built is not None
    src = Path(built.__file__).parent
    shutil.copytree(src, tmp_path / src.name, symlinks=True)
    (tmp_path / src.name / "lock").touch()
    code = "from engine.cpu import kernels; m = kernels.load(); print(m.isa if m is not None else None)"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == built.isa, done.stderr
    assert "left it" in done.stderr  # the warning naming the stale file
    assert not (tmp_path / src.name / "lock").exists()


class _FakeExtensions:
    """cpp_extension's lock protocol (a FileBaton on `lock`, taken by every load) around a build that blocks
    until released: lets a test hold one build open while a second load starts."""

    def __init__(self, root: Path):
        self.root, self.release, self.events = root, threading.Event(), []

    def _get_build_directory(self, name, verbose):
        path = self.root / name
        path.mkdir(exist_ok=True)
        return str(path)

    def load(self, name, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if not baton.try_acquire():
            baton.wait()
            self.events.append("waited on torch's lock")
            return name
        self.events.append("building")
        self.release.wait(10)
        lock_still_ours = os.path.exists(baton.lock_file_path)
        baton.release()
        self.events.append("built" if lock_still_ours else "lock deleted under a live build")
        return name


def test_a_second_load_waits_for_a_live_build_and_leaves_its_lock_alone(tmp_path):
    fake = _FakeExtensions(tmp_path)
    first = threading.Thread(target=kernels._load_locked, args=(fake, "ext"))
    first.start()
    deadline = time.monotonic() + 10
    while fake.events != ["building"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.events == ["building"]
    second = threading.Thread(target=kernels._load_locked, args=(fake, "ext"))
    second.start()
    time.sleep(0.3)
    assert fake.events == ["building"]  # the second load is held on the flock, not inside torch's load
    fake.release.set()
    first.join(10)
    second.join(10)
    # The first build kept its lock to the end; the second then found none and took its own.
    assert fake.events == ["building", "built", "building", "built"]
