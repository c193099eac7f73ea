"""The supported range is declared once (torch >= 2.11, triton >= 3.6) and enforced with a clear message."""

import pytest
import torch

from transformer_kernels import _backend


@pytest.mark.parametrize(
    "version, minimum, too_old",
    [
        ("2.11.0", (2, 11), False),
        ("2.11.0a0+git1234abc", (2, 11), False),
        ("2.13.0+cpu", (2, 11), False),
        ("2.10.1+cu128", (2, 11), True),
        ("1.13.1", (2, 11), True),
        ("3.6.0", (3, 6), False),
        ("3.5.1", (3, 6), True),
        ("3.10.0", (3, 6), False),
    ],
)
def test_version_reason(version, minimum, too_old):
    reason = _backend.version_reason("pkg", version, minimum)
    if too_old:
        assert reason == f"pkg {version} is older than {minimum[0]}.{minimum[1]}, the oldest supported"
    else:
        assert reason is None


def test_installed_stack_is_supported():
    assert _backend.version_reason("torch", torch.__version__, _backend.MIN_TORCH) is None
    _backend.check_torch_version()
    triton = pytest.importorskip("triton")
    from transformer_kernels.backends import triton as triton_backend

    assert _backend.version_reason("triton", triton.__version__, triton_backend.MIN_TRITON) is None
    assert triton_backend.triton_reason() is None
