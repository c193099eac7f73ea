"""A training step of each seed model reads no value back to the host, dropout included, on every
backend a GPU runs it on: so it syncs with the GPU nowhere, and a user can capture it in a CUDA
graph (``torch.cuda.graph``, or ``torch.compile(mode="reduce-overhead")``).  Checked on the CPU,
Triton interpreted; on a GPU, compiled.  The eager backend is left out: on a CPU it reads a padding
mask back where that saves work (``_every_row_sees_a_key``).  The recorder descends into our
registered ops, so what their backends run is checked too.  (Generation's steps:
``test_generation.py``.)"""

import pytest
import torch
import torch.nn.functional as F
from _helpers import OpRecorder, backend_params, device_for, reads_back, small_seed_model

from transformer_kernels import use_backend
from transformer_kernels.train import logits_of

PAD = 0


@pytest.mark.parametrize("backend", backend_params(names=("triton",)))
@pytest.mark.parametrize("family", ["transformer", "convs2s"])
def test_training_step_reads_nothing_back(family, backend):
    device = device_for(backend)
    model = small_seed_model(family, num_decoder_layers=1, dropout=0.1).to(device).train()
    src = torch.randint(3, 40, (2, 7), device=device)
    tgt = torch.randint(3, 40, (2, 6), device=device)
    src[1, 4:] = PAD
    tgt[0, 4:] = PAD
    with use_backend(backend), OpRecorder(reads_back, descend=True) as recorder:
        logits = logits_of(model, src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)
        loss.backward()
    assert recorder.ops == []
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
