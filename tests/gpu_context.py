"""A pytest plugin (tests/conftest.py loads it): a GPU test whose kernel faults leaves the process's
CUDA context unusable, and every later CUDA call of that process fails with the same error. On
the first H200 run one faulting test turned all 15 tests after it into failures that said nothing
about their own kernels. Now, once a gpu-marked test has failed with such an error, the process's
later gpu-marked tests are skipped, naming the test that lost the context, and their ids are
appended to the file named by CUPY_ATTN_CONTEXT_LOST, from which bench/gpu_check.sh runs them again
in fresh processes; so is the failed test's own, since a kernel's fault may surface at a later
test's first CUDA call (launches are asynchronous)."""
import os

import pytest

# The errors that end a context (CUDA's "sticky" errors), by the driver's descriptions (CuPy's and
# PyTorch's exceptions quote them) and by their names in the driver and runtime APIs.
CONTEXT_ENDING = ("an illegal instruction was encountered", "an illegal memory access was encountered",
                  "misaligned address", "unspecified launch failure", "device-side assert triggered",
                  "hardware stack error", "invalid program counter", "the launch timed out and was terminated",
                  "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS",
                  "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ASSERT", "CUDA_ERROR_HARDWARE_STACK_ERROR",
                  "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_TIMEOUT", "cudaErrorIllegalInstruction",
                  "cudaErrorIllegalAddress", "cudaErrorMisalignedAddress", "cudaErrorLaunchFailure", "cudaErrorAssert",
                  "cudaErrorHardwareStackError", "cudaErrorInvalidPc", "cudaErrorLaunchTimeout")
LOG_VARIABLE = "CUPY_ATTN_CONTEXT_LOST"

_lost_to = []  # the test (and error) that ended this process's context


def ends_context(exc: BaseException) -> bool:
    return any(phrase in str(exc) for phrase in CONTEXT_ENDING)


def _to_run_again(nodeid: str) -> None:
    log = os.environ.get(LOG_VARIABLE)
    if log:
        with open(log, "a") as f:
            f.write(nodeid + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if (call.excinfo is not None and not _lost_to and "gpu" in item.keywords
            and ends_context(call.excinfo.value)):
        _lost_to.append(f"{item.nodeid} ({call.excinfo.typename})")
        _to_run_again(item.nodeid)


def pytest_runtest_setup(item):
    if _lost_to and "gpu" in item.keywords:
        _to_run_again(item.nodeid)
        pytest.skip(f"the CUDA context was lost to {_lost_to[0]}: to be run in a fresh process")
