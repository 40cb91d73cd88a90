"""Test configuration: where the Triton kernels are checked, decided once for the whole run.

* No CUDA device (CI, most laptops): Triton's interpreter runs the kernels on CPU tensors. TRITON_INTERPRET=1
  is set here, before any test module imports fastrl, because Triton decides at decoration time.
* A CUDA device: the kernels run compiled (TRITON_INTERPRET=0), and ``tests/test_cuda.py`` checks them on CUDA
  tensors against float64. A process interprets either every kernel or none, so the tests that run the triton
  backend on CPU tensors cannot run there: they are skipped with the reason (the torch-backend half of each of
  them still runs). Which tests those are: any test parametrised with a ``backend`` starting with "triton"
  outside test_cuda.py / test_cuda_kernels.py, and any test marked ``@pytest.mark.interpreter``.

Nobody has to set a variable by hand; one set explicitly is respected (``TRITON_INTERPRET=1`` on a GPU machine
interprets everything, and then test_cuda.py, which exists to test compiled kernels, skips with the reason).
"""

import os
import sys

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

# Backends the CPU test-suite checks: the chunked torch path and the Triton kernels (interpreted). "triton"
# is what users get (the hybrid kernels, as on a current CUDA install); the op-level tests also run each
# Triton implementation by name.
CPU_BACKENDS = ("torch", "triton")
KERNEL_BACKENDS = ("torch", "triton-hybrid", "triton-fused")

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
NEEDS_INTERPRETER = (
    "runs the Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1; this run compiles them for the GPU "
    "(tests/test_cuda.py checks them there on CUDA tensors)"
)


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs the Triton kernels on CPU tensors (TRITON_INTERPRET=1)")


def pytest_runtest_logreport(report):
    """``FASTRL_INSTAFAIL=1`` (bench/gpu_session.sh): a failure's traceback written the moment it happens, so a run
    cut at its time limit, before pytest's summary, still shows why each test failed."""
    if report.failed and os.environ.get("FASTRL_INSTAFAIL") == "1":
        sys.__stderr__.write(f"\n{report.nodeid} ({report.when}) FAILED:\n{report.longreprtext}\n")
        sys.__stderr__.flush()


def pytest_collection_modifyitems(config, items):
    if INTERPRET:
        return
    skip = pytest.mark.skip(reason=NEEDS_INTERPRETER)
    for item in items:
        spec = getattr(item, "callspec", None)
        backend = str(spec.params.get("backend", "")) if spec is not None else ""
        on_gpu_already = item.path.name in ("test_cuda.py", "test_cuda_kernels.py")
        triton_on_cpu = backend.startswith("triton") and not on_gpu_already
        if triton_on_cpu or item.get_closest_marker("interpreter"):
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny matmuls (threads only add contention on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
