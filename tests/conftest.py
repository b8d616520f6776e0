import os
import zlib

import numpy as np
import pytest

from cupy_attn import _numpy_backend, _nvrtc

# Later GPU tests skipped, not failed, once a kernel fault has ended the CUDA context.
from gpu_context import pytest_runtest_makereport, pytest_runtest_setup  # noqa: E402,F401

DEFAULT_TILES = (_numpy_backend.BLOCK_M, _numpy_backend.BLOCK_N)


@pytest.fixture(autouse=True)
def small_key_tiles(monkeypatch):
    """Shrink the NumPy backend's tiles to an awkward 40 × 48 so small inputs cross many tiles,
    partial last tiles and skipped tiles. Tests that need the default request `default_tiles`."""
    monkeypatch.setattr(_numpy_backend, "BLOCK_N", 48)
    monkeypatch.setattr(_numpy_backend, "BLOCK_M", 40)


@pytest.fixture(scope="session", autouse=True)
def nvrtc_cache(tmp_path_factory):
    """One cache of NVRTC results (_nvrtc.CACHE_ENVIRONMENT) per test run, shared by its xdist
    workers and the scripts they start, unless one is set already."""
    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the worker's directory, in the run's
        run = run.parent
    os.environ.setdefault(_nvrtc.CACHE_ENVIRONMENT, str(run / "nvrtc"))


@pytest.fixture
def default_tiles(monkeypatch):
    monkeypatch.setattr(_numpy_backend, "BLOCK_M", DEFAULT_TILES[0])
    monkeypatch.setattr(_numpy_backend, "BLOCK_N", DEFAULT_TILES[1])


@pytest.fixture
def rng(request):
    # A seed per test, stable across runs, different between tests.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_configure(config):
    """Under pytest-xdist's --dist loadfile (the README's test command) hand out the test files in
    collection order, not most tests first (its default, --loadscope-reorder): the slowest file,
    the compile report's, has few tests, so that order starts it last and it runs alone at the end
    (six of CI's 25 minutes on two cores)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """gpu-marked tests run only where CuPy reaches a GPU; elsewhere they are skipped, saying why."""
    from cupy_attn import _backends

    usable, why = _backends.cuda_status()
    if usable:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
