"""Placeholder: being written."""


def qkv_projection(*args, **kwargs):
    raise NotImplementedError
