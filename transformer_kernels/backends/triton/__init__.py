"""Triton kernels, one module per op; ``_common`` holds what they share.

Modules here import triton at import time, so only import them once the
triton backend was chosen.
"""
