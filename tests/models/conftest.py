import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tensors of a few KB: threads only add waiting, and a shared CPU makes it 40x slower.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
