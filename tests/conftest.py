import os

import pytest
import torch

# Triton's interpreter must be switched on before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA = torch.cuda.is_available()
# Where the triton backend runs in tests: real kernels on a GPU, the interpreter on CPU.
TRITON_DEVICE = torch.device("cuda" if CUDA else "cpu")
if CUDA:
    os.environ["TRITON_INTERPRET"] = "0"

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
