import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter, so the CPU suite
    # checks them against the PyTorch reference. Must be set before engine.attention is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    # scripts/test.sh runs test files side by side (pytest-xdist): each worker's intra-op threads take its share
    # of the CPUs. With every worker at torch's default (one thread per CPU), the OpenMP teams outnumber the CPUs
    # and wait at every op for each other's preempted threads (docs/architecture.md#tests). Processes the tests
    # start (Ray actors, servers, core processes) keep their own settings.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """get(family, num_hidden_layers=None) -> (checkpoint dir, HF reference model), cached per session
    (None: the family's default of 2 layers; pipeline tests need more to split)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache = {}

    def get(family: str, num_hidden_layers: int | None = None):
        key = (family, num_hidden_layers)
        if key not in cache:
            if num_hidden_layers is None:
                cache[key] = tiny_models.build(family, root)
            else:
                cache[key] = tiny_models.build(family, root / f"layers{num_hidden_layers}",
                                               num_hidden_layers=num_hidden_layers)
        return cache[key]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords also hold directory names (a checkout named gpu).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
