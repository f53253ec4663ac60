"""Run order: the fast in-process tier first, so that a failure shows within the first minutes.

pytest runs tests in collection order (file by file, alphabetically under ``pytest tests``). The
tests that start real processes (horovodrun, mpirun, torchrun: marked ``horovod``/``torchdist``)
and those allowed more than the default timeout (builds, Docker) are moved after all the others;
the order inside each tier is kept. One pytest invocation still runs everything, so its closing
line (``N passed``) counts every test.
"""

import pytest
import torch

MULTI_PROCESS_MARKERS = ("horovod", "torchdist")
DEFAULT_TIMEOUT_S = 300  # pytest.ini's timeout


def _is_slow(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(name) for name in MULTI_PROCESS_MARKERS):
        return True
    # Only the test's own timeout mark: a module-wide one also covers its fast tests.
    marks = [m for m in item.own_markers if m.name == "timeout" and m.args]
    return any(float(m.args[0]) > DEFAULT_TIMEOUT_S for m in marks)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_is_slow)  # stable: the order inside each tier is unchanged


@pytest.fixture
def one_intra_op_thread():
    """Bitwise comparisons need one intra-op thread: with two, a matmul in the main thread (the
    reference) may split its work differently from the same matmul in a worker thread (seen
    here: MKL, 2 OpenMP threads), which changes its last bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
