import pytest
import torch

from tests.glm5._util import make_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny shapes gain nothing from intra-op threads, and on a loaded 2-core runner OpenMP spin-waits
    # make each small op ~20x slower; restored afterwards for the other test packages
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return make_model()
