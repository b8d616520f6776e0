import zlib

import numpy as np
import pytest

from cupy_attn import _numpy_backend


@pytest.fixture(autouse=True)
def small_key_tiles(monkeypatch):
    """Shrink the NumPy backend's key tile to an awkward 48 so small inputs cross many tiles,
    partial last tiles and skipped tiles. Tests that need the default request `default_tiles`."""
    monkeypatch.setattr(_numpy_backend, "BLOCK_N", 48)


@pytest.fixture
def default_tiles(monkeypatch):
    monkeypatch.setattr(_numpy_backend, "BLOCK_N", 256)


@pytest.fixture
def rng(request):
    # A seed per test, stable across runs, different between tests.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
