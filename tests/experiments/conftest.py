import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests, as in a sweep's workers (see affdiv.experiments.runs.sweep),
    whatever an earlier test set: a reduction split over threads may round differently. Used by
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits():
    """The digits dataset, loaded once per test module."""
    from affdiv.experiments.data.dataset import load_dataset

    return load_dataset("digits")
