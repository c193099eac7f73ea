"""``setup.py``'s decision about the CUDA extension, and the package without it.

``python setup.py --name`` runs the decision without building anything: one stderr line when it
skips the extension (and why), an error naming the fix when ``TRANSFORMER_KERNELS_BUILD_CUDA=1``
forces a build that cannot happen.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import transformer_kernels.backends.cuda as cuda_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_name(tmp_path, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMER_KERNELS_BUILD_CUDA", "CUTLASS_PATH")}
    environment.update(env)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=environment, capture_output=True,
                          text=True)


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA here: setup.py would build")
def test_cpu_torch_installs_the_python_package_and_says_why_in_one_line(tmp_path):
    result = _setup_name(tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "transformer_kernels"
    lines = [line for line in result.stderr.splitlines() if "transformer_kernels" in line]
    assert lines == [
        f"transformer_kernels: CUDA extension skipped: torch {torch.__version__} has no CUDA "
        "(set TRANSFORMER_KERNELS_BUILD_CUDA=1 to build anyway)"
    ]


def test_build_switched_off_installs_the_python_package_and_says_so(tmp_path):
    # What gpu_check.sh's budget run installs on a CUDA machine, where setup.py would otherwise build.
    result = _setup_name(tmp_path, TRANSFORMER_KERNELS_BUILD_CUDA="0")
    assert result.returncode == 0 and result.stdout.strip() == "transformer_kernels"
    lines = [line for line in result.stderr.splitlines() if "transformer_kernels" in line]
    assert lines == ["transformer_kernels: CUDA extension skipped: TRANSFORMER_KERNELS_BUILD_CUDA=0"]


def test_forced_build_without_cutlass_names_the_package_to_install(tmp_path):
    hidden = tmp_path / "hide" / "cutlass_library"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    result = _setup_name(tmp_path, TRANSFORMER_KERNELS_BUILD_CUDA="1", PYTHONPATH=str(hidden.parent))
    assert result.returncode != 0
    assert "cannot build the CUDA extension" in result.stderr and "pip install nvidia-cutlass" in result.stderr


def test_forced_build_with_a_wrong_cutlass_path_says_so(tmp_path):
    result = _setup_name(tmp_path, TRANSFORMER_KERNELS_BUILD_CUDA="1", CUTLASS_PATH=str(tmp_path))
    assert result.returncode != 0
    assert f"CUTLASS_PATH={tmp_path} holds no include/cute/tensor.hpp" in result.stderr


def test_without_the_extension_the_cuda_backend_explains(monkeypatch):
    # What the device check asks (kept once per process, as a constant to torch.compile), here
    # answered as on a machine without the extension, also where it is built.
    monkeypatch.setattr(cuda_backend, "_extension_built", lambda: False)
    assert cuda_backend._device_reason(torch.device("cuda"), torch.float16) == (
        "the CUDA extension transformer_kernels._C is not built"
    )


def test_cxx_probe_picks_the_first_compiler_whose_extension_raises():
    """benchmarks/cxx_probe.py, with which gpu_check.sh picks the extension's compiler on the GPU
    machine (its $CXX builds extensions that die at their first refusal): a "compiler" that cannot
    build (``false``) is passed over, and the host compiler's probe must build and raise, or the
    probe itself is broken."""
    compiler, unusable = shutil.which("c++"), shutil.which("false")
    if compiler is None or unusable is None:
        pytest.skip("no host C++ compiler, or no false")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cxx_probe.py"), "--pick", unusable, compiler],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == compiler
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(unusable) and "build failed" in lines[0]
    assert lines[1].endswith("raised: refuse: x must be 99-d, got n = 4, shape [2, 3], dtype Float")
