"""For every Triton compile target, print as JSON whether its launch runs directly on its compiled
kernel (``DirectLaunch``), and whether that is sound under the installed Triton: the arguments it
hands the compiled kernel are those Triton's own binder gives, and the specialization Triton works
out for the launch with any one tensor moved off its 16-byte alignment is the same wherever
``DirectLaunch``'s key for it is (so the key picks the right compiled kernel).

Run in its own process by ``test_triton_direct_launch.py``: Triton's binder exists only for
compiled kernels, and the test session interprets them (``TRITON_INTERPRET=1``).
"""

import json
import os

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from _compile_targets import MODULES  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402


def _misaligned(value):
    """A tensor like ``value`` one element past a 16-byte boundary; anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.numel() + 1, dtype=value.dtype)[1:].view(value.shape)


def _same(a, b) -> bool:
    return a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b and type(a) is type(b)


def _moved(launch):
    """``(args, kwargs)`` of ``launch`` with each of its tensors in turn moved off 16-byte alignment."""
    for index, value in enumerate(launch.args):
        if isinstance(value, torch.Tensor):
            yield (*launch.args[:index], _misaligned(value), *launch.args[index + 1:]), launch.kwargs
    for name, value in launch.kwargs.items():
        if isinstance(value, torch.Tensor):
            yield launch.args, {**launch.kwargs, name: _misaligned(value)}


def facts(launch, capability: int) -> dict:
    if launch.direct is None:
        return {"direct": False}
    binder = create_function_from_signature(
        launch.kernel.signature, launch.kernel.params, make_backend(GPUTarget("cuda", capability, 32))
    )

    def variant(args, kwargs):
        """Triton's bound arguments and specialization of a launch, and the key ``DirectLaunch``
        files its compiled kernel under."""
        bound, specialization, _ = binder(*args, **kwargs)
        moved = launch._replace(args=args, kwargs=kwargs)
        return bound, list(map(str, specialization)), launch.direct.key(0, launch.direct.arguments(moved))

    bound, specialization, key = variant(launch.args, launch.kwargs)
    arguments = launch.direct.arguments(launch)
    # Where the key stays for a moved tensor, the variant must stay too.
    key_determines_variant = all(
        moved_key != key or moved_specialization == specialization
        for _, moved_specialization, moved_key in (variant(*moved) for moved in _moved(launch))
    )
    return {
        "direct": True,
        "arguments_match": len(arguments) == len(bound)
        and all(_same(a, b) for a, b in zip(arguments, bound.values())),
        "key_determines_variant": key_determines_variant,
        "key_holds_addresses": bool(launch.direct.aligned_slots),
    }


def main() -> None:
    result = {}
    for module_name, module in MODULES.items():
        for target in module.compile_targets():
            for capability in target.capabilities:
                result[f"{module_name}/{target.name}@sm_{capability}"] = facts(target.launch(), capability)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
