"""One module per op: argument checks, normalization, torch.library registration, autograd."""
