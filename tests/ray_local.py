"""A local Ray session for tests that start actors in process (stage actors, tensor-parallel workers)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def local_ray(num_cpus: int, namespace: str):
    """ray.init on this machine with its own short temp dir (Ray's socket paths must stay short), torn down
    after; yields the ray module."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    temp_dir = tempfile.mkdtemp(prefix="tdr", dir="/tmp")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             namespace=namespace)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
