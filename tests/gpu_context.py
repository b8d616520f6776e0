"""A pytest plugin (tests/conftest.py loads it): a GPU test whose kernel faults leaves the process's
CUDA context unusable, and every later CUDA call of that process fails with the same error. On
the first H200 run one faulting test turned all 15 tests after it into failures that said nothing
about their own kernels. Now, once a gpu-marked test has failed with such an error, the process's
later gpu-marked tests are skipped, naming the test that lost the context, and their ids are
appended to the file named by CUPY_ATTN_CONTEXT_LOST, from which bench/gpu_check.sh runs them again
in fresh processes."""
import os

import pytest

# The driver's descriptions of the errors that end a context (CUDA's "sticky" errors), as CuPy's
# and PyTorch's exceptions quote them.
CONTEXT_ENDING = ("an illegal instruction was encountered", "an illegal memory access was encountered",
                  "misaligned address", "unspecified launch failure", "device-side assert triggered",
                  "hardware stack error", "invalid program counter", "the launch timed out and was terminated")
LOG_VARIABLE = "CUPY_ATTN_CONTEXT_LOST"

_lost_to = []  # the test (and error) that ended this process's context


def ends_context(exc: BaseException) -> bool:
    return any(phrase in str(exc) for phrase in CONTEXT_ENDING)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if (call.excinfo is not None and not _lost_to and "gpu" in item.keywords
            and ends_context(call.excinfo.value)):
        _lost_to.append(f"{item.nodeid} ({call.excinfo.typename})")


def pytest_runtest_setup(item):
    if _lost_to and "gpu" in item.keywords:
        log = os.environ.get(LOG_VARIABLE)
        if log:
            with open(log, "a") as f:
                f.write(item.nodeid + "\n")
        pytest.skip(f"the CUDA context was lost to {_lost_to[0]}: to be run in a fresh process")
