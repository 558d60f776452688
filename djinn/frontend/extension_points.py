"""Every place Djinn plugs into PyTorch, and nothing else.

Each plug is an ``Attachment``: attached when its first holder acquires it, detached when
its last holder releases it, so none outlives its use and each can be undone (the test
``tests/unit/test_extension_points.py`` attaches and detaches every one and checks that
PyTorch is as it was). Which holder, and so which scope, each one has:

| attachment      | what it plugs in                                 | held by, scope        |
|-----------------|--------------------------------------------------|-----------------------|
| BACKEND         | the PrivateUse1 backend and its device module    | ``import djinn``      |
| KERNELS         | PrivateUse1 fallback, ``_to_copy`` (which also   | ``import djinn``      |
|                 | routes ``model.to`` to the model path: Note      |                       |
|                 | [module to]), attention (Note [fused attention]),|                       |
|                 | autocast,                                        |                       |
|                 | pinned-memory kernels (dispatcher registrations) |                       |
| SERIALIZATION   | a ``torch.serialization`` package                | ``import djinn``      |
| FOREACH_TYPES   | LazyTensor among the types PyTorch's optimizers  | ``import djinn``      |
|                 | and ``clip_grad_norm_`` give their foreach path  |                       |
|                 | by default (Note [foreach by default])           |                       |
| FORWARD_HOOKS   | global module forward hooks (module paths)       | open ``capture()``    |
| CUDA_QUERIES    | ``torch.cuda`` queries answered for the appliance| ``djinn run``         |
| ACCELERATE_FP16 | the remote device among accelerate's fp16 devices| ``djinn run``         |
|                 | (Note [accelerate's fp16])                       |                       |
| MAPPED_GENERATOR| ``torch.Generator("cuda")`` makes a CPU generator| ``djinn run``         |
|                 | (mapped_generator.py)                            |                       |
| META_PARAMETERS | a parameter-registration hook (ghost loading)    | ``from_pretrained``   |
| RECORDING_HOOKS | global module-forward and optimizer-step hooks   | a ``replayable``      |
|                 | (what a recording used: Note [replayable         | recording             |
|                 | functions])                                      |                       |
| DYNAMO_SKIP     | Djinn's files in dynamo's skip list (Note        | ``import djinn``      |
|                 | [dynamo skips djinn])                            |                       |
| COMPILE_REMOTE  | inductor's ``compile_fx`` and dynamo's           | ``import djinn``      |
|                 | ``clone_input`` wrapped for remote values (Note  |                       |
|                 | [torch.compile and remote values])               |                       |

Note [python backend]: ``rename_privateuse1_backend`` alone makes the device string
legal, but a tensor subclass on that device *aborts the process* (a C++ error, no
exception) as soon as autograd touches a leaf that requires grad, because PyTorch has no
device guard for it. ``_setup_privateuseone_for_python_backend`` (experimental, private)
also registers a Python device guard, hooks and a device module (``device_module.py``,
what ``torch.remote_accelerator`` is), after which LazyTensors work through forward and
``backward()``. PyTorch cannot unregister a backend, so BACKEND's detach only forgets
it; a backend nobody dispatches to changes nothing for other devices.
``tests/unit/test_device_backend.py`` pins the behaviour we rely on.

Note [dispatcher kernels]: kernels registered through ``torch.library`` only act on
tensors of the remote device (PrivateUse1, AutocastPrivateUse1), except the pinned-memory
pair, which acts on CPU tensors and is registered only where PyTorch's own kernel could
only raise (Note [pinned memory]). Dropping a ``Library`` unregisters its kernels.

Note [cuda queries]: ``torch.cuda``'s query functions are module attributes, so answering
them for the appliance is process-wide; it is held only by ``djinn run``, whose process
is the mapped script.

Note [meta parameters]: ghost loading builds a model whose parameters are on ``meta``
while its buffers stay real; a global parameter-registration hook does that only on the
thread inside ``parameters_on_meta()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import (
    accelerate_fp16,
    affine_grid,
    attention,
    autocast,
    compile_remote,
    device_module,
    dynamo_skip,
    factories,
    hook_errors,
    hooks,
    legacy_types,
    mapped_generator,
    one_hot,
    pinned,
    recurrent,
    serialization,
    storages,
    transformer_fastpath,
    uncaptured,
)
from .device import DEVICE_TYPE

_lock = threading.RLock()


class Attachment:
    """One plug into PyTorch, reference-counted: attached while anyone holds it."""

    def __init__(self, name: str, attach: Callable[[], Any], detach: Callable[[Any], None]) -> None:
        self.name = name
        self._attach = attach
        self._detach = detach
        self.holders = 0
        self._state: Any = None

    def acquire(self) -> None:
        with _lock:
            if self.holders == 0:
                self._state = self._attach()
            self.holders += 1

    def release(self) -> None:
        with _lock:
            if self.holders == 0:
                return
            self.holders -= 1
            if self.holders == 0:
                self._detach(self._state)
                self._state = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


# -- BACKEND: Note [python backend] ---------------------------------------------------------
def _attach_backend() -> None:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=device_module)
    elif name != DEVICE_TYPE:
        raise RuntimeError(
            f"another PrivateUse1 backend is registered ({name}); Djinn cannot share it"
        )


# -- KERNELS: Note [dispatcher kernels] -----------------------------------------------------
def _attach_kernels() -> list[torch.library.Library]:
    libraries = []
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(factories.fallback, "PrivateUse1")
    libraries.append(lib)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_to_copy", factories.to_copy, "PrivateUse1")  # Note [to_copy kernel]
    # Note [fused attention]: on the autograd key, above the op's own decomposition
    # (torch.inference_mode() skips that key: there, attention stays decomposed)
    lib.impl(
        "scaled_dot_product_attention",
        attention.scaled_dot_product_attention,
        "AutogradPrivateUse1",
    )
    # Note [recurrent layers], Note [transformer fast path], Note [affine grid backward]
    # and Note [one-hot layout]
    for module in (recurrent, transformer_fastpath, affine_grid, one_hot):
        for name, kernel in module.KERNELS.items():
            lib.impl(name, kernel, "AutogradPrivateUse1")
    for name in uncaptured.KERNELS_OVER_FORMULAS:  # Note [kernels over formulas]
        lib.impl(name, uncaptured.below_autograd(name), "AutogradPrivateUse1")
    libraries.append(lib)
    # autocast: every op falls through, the listed ones get CUDA's casts. A Python
    # *fallback* on this key makes PyTorch assert (func != nullptr, python_dispatch.cpp).
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    libraries.append(lib)
    lib = torch.library.Library("aten", "IMPL")
    for qualified, kernel in autocast.kernels():
        lib.impl(qualified, kernel, "AutocastPrivateUse1")
    libraries.append(lib)
    if not torch.cuda.is_available():  # Note [pinned memory]
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_pin_memory", pinned.pin_memory, "CPU")
        lib.impl("is_pinned", pinned.is_pinned, "CPU")
        libraries.append(lib)
        pinned.OURS[0] = True
    elif kernels := pinned.beside_cuda():  # Note [pinned memory beside CUDA]
        lib = torch.library.Library("aten", "IMPL")
        for name, kernel in kernels.items():
            lib.impl(name, kernel, "CPU", with_keyset=True)
        libraries.append(lib)
    return libraries


def _detach_kernels(libraries: list[torch.library.Library]) -> None:
    for lib in reversed(libraries):
        lib._destroy()
    pinned.OURS[0] = False


# -- SERIALIZATION: Note [load to the remote device] (serialization.py) -------------------
def _attach_serialization() -> tuple:
    torch.serialization.register_package(
        serialization.PRIORITY, serialization.tag, serialization.deserialize
    )
    return next(
        entry
        for entry in torch.serialization._package_registry
        if entry[2] is serialization.deserialize
    )


def _detach_serialization(entry: tuple) -> None:
    if entry in torch.serialization._package_registry:
        torch.serialization._package_registry.remove(entry)


# -- FOREACH_TYPES: Note [foreach by default] -----------------------------------------------
# PyTorch gives an optimizer (and clip_grad_norm_) its foreach path by default when every
# parameter is on a device with foreach kernels (CUDA, and the PrivateUse1 backend, which is
# this one) *and* of a type in a list, which a tensor subclass joins the way DTensor does.
# Without it a remote model took the CPU's default, the single-tensor loop: a small
# TransformerEncoder's Adam training step captured 435 ops instead of 260, and 20 steps
# took 0.52 s instead of 0.43 (benchmarks/training_step.py, foreach=True asked for). On a
# CPU, local eager's two paths gave the same bits for that loop; the remote default is
# checked against local eager's default (tests/integration/test_foreach.py). Not every
# optimizer's two paths round alike: NAdam, RAdam and ASGD by default end a few float32
# ulps from local CPU eager (7 NAdam steps: 6e-8; a review), as a CUDA run of the same
# program, which takes the foreach path too; ``foreach=False`` gives CPU eager's bits.
def _foreach_type_lists() -> list[list[Any]]:
    import importlib

    # torch.optim deletes its `optimizer` attribute: the module is reached by name
    names = ("torch.optim.optimizer", "torch.utils._foreach_utils")
    return [importlib.import_module(n)._foreach_supported_types for n in names]


def _attach_foreach_types() -> list[list[Any]]:
    from .lazy import LazyTensor

    joined = [types for types in _foreach_type_lists() if LazyTensor not in types]
    for types in joined:
        types.append(LazyTensor)
    return joined


def _detach_foreach_types(joined: list[list[Any]]) -> None:
    from .lazy import LazyTensor

    for types in joined:
        if LazyTensor in types:
            types.remove(LazyTensor)


# -- BACKWARD_HOOKS: Note [errors in hooks during backward] (hook_errors.py) ---------------
def _attach_backward_hooks() -> Any:
    from .lazy import LazyTensor

    return hook_errors.attach(LazyTensor)


# -- FORWARD_HOOKS: module paths for captured ops (hooks.py) --------------------------------
def _attach_forward_hooks() -> list[Any]:
    return [
        torch.nn.modules.module.register_module_forward_pre_hook(hooks.pre),
        torch.nn.modules.module.register_module_forward_hook(hooks.post, always_call=True),
    ]


def _detach_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


# -- CUDA_QUERIES: Note [cuda queries] ------------------------------------------------------
CUDA_QUERIES_NAMES = (
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "synchronize",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "device",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "mem_get_info",
    "reset_peak_memory_stats",
    "memory_stats",
    "empty_cache",
    "is_bf16_supported",
    "initial_seed",
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "stream",
)
NVTX_NAMES = {"range_push": "nvtx_range_push", "range_pop": "nvtx_range_pop", "mark": "nvtx_mark"}
# torch.cuda's seeding, as CUDA's: the remote device's generator, never the CPU one
# (device_module.cuda_manual_seed says why)
SEEDING_NAMES = {
    "manual_seed": "cuda_manual_seed",
    "manual_seed_all": "cuda_manual_seed",
    "seed": "cuda_seed",
    "seed_all": "cuda_seed",
}


def _cuda_parts() -> dict[str, Any]:
    """torch.cuda's submodules whose functions CUDA_QUERIES replaces too, by the prefix
    their saved names take: ``torch.cuda.random.manual_seed`` is the function
    ``torch.cuda.manual_seed`` names, and a script may call it by either name."""
    import torch.cuda.memory as cuda_memory
    import torch.cuda.nvtx as nvtx
    import torch.cuda.random as cuda_random

    # the generator's state by torch.cuda.random's own names too (Trainer's checkpoints
    # save it as torch.cuda.random.get_rng_state_all(): "not compiled with CUDA", a review)
    states = {n: n for n in CUDA_QUERIES_NAMES if "rng_state" in n}
    return {
        "nvtx.": (nvtx, NVTX_NAMES),
        "random.": (cuda_random, {**SEEDING_NAMES, **states}),
        # memory_summary() reads memory_stats() by its own module's name
        "memory.": (cuda_memory, {"memory_stats": "memory_stats"}),
    }


def _attach_cuda_queries() -> dict[str, Any]:
    saved = {name: getattr(torch.cuda, name) for name in (*CUDA_QUERIES_NAMES, *SEEDING_NAMES)}
    for name in CUDA_QUERIES_NAMES:
        setattr(torch.cuda, name, getattr(device_module, name))
    for name, ours in SEEDING_NAMES.items():
        setattr(torch.cuda, name, getattr(device_module, ours))
    for prefix, (module, names) in _cuda_parts().items():
        for name, ours in names.items():
            saved[prefix + name] = getattr(module, name)
            setattr(module, name, getattr(device_module, ours))
    return saved


def _detach_cuda_queries(saved: dict[str, Any]) -> None:
    parts = _cuda_parts()
    for name, fn in saved.items():
        prefix, dot, rest = name.partition(".")
        module = parts[prefix + dot][0] if dot else torch.cuda
        setattr(module, rest if dot else name, fn)


# -- LEGACY_TYPES: Note [legacy CUDA tensor types] (legacy_types.py) -----------------------
def _attach_legacy_types() -> dict[str, Any]:
    saved = {name: getattr(torch.cuda, name, None) for name in legacy_types.STAND_INS}
    for name, cls in legacy_types.STAND_INS.items():
        setattr(torch.cuda, name, cls)
    saved["set_default_tensor_type"] = torch.set_default_tensor_type
    torch.set_default_tensor_type = legacy_types.default_tensor_type(torch.set_default_tensor_type)
    return saved


def _detach_legacy_types(saved: dict[str, Any]) -> None:
    torch.set_default_tensor_type = saved.pop("set_default_tensor_type")
    for name, cls in saved.items():
        setattr(torch.cuda, name, cls)


# -- META_PARAMETERS: Note [meta parameters] ------------------------------------------------
_meta_local = threading.local()


def _to_meta(module: torch.nn.Module, name: str, param: Any) -> Any:
    if not getattr(_meta_local, "depth", 0):
        return None  # another thread, or no ghost build under way: PyTorch as usual
    if param is not None and param.device.type != "meta":
        return torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    return None


def _attach_meta_parameters() -> Any:
    return torch.nn.modules.module.register_module_parameter_registration_hook(_to_meta)


# -- RECORDING_HOOKS: Note [replayable functions] (replayable.py) ----------------------------
_watchers: list[Any] = []  # recordings under way: told each module forward, optimizer step


def _module_ran(module: torch.nn.Module, _args: Any) -> None:
    for watcher in list(_watchers):
        watcher.module_ran(module)


def _stepped(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    with_args = len(args) > 1 or bool(kwargs)  # args[0] is the optimizer itself
    for watcher in list(_watchers):
        watcher.stepped(opt, with_args)


def _step_done(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    for watcher in list(_watchers):
        watcher.step_done(opt)


def _attach_recording_hooks() -> list[Any]:
    from torch.optim import optimizer

    pre = optimizer.register_optimizer_step_pre_hook(_stepped)
    # first of the pre-hooks, and (registered last) last of the post-hooks: what any other
    # hook captures is part of the step, which a replay runs whole (Note [optimizer steps
    # run, not replayed]); a user's global pre-hook registered earlier ran before it, so
    # its ops were replayed and then ran again in the step
    optimizer._global_optimizer_pre_hooks.move_to_end(pre.id, last=False)
    return [
        torch.nn.modules.module.register_module_forward_pre_hook(_module_ran),
        pre,
        optimizer.register_optimizer_step_post_hook(_step_done),
    ]


BACKEND = Attachment("backend", _attach_backend, lambda _state: None)
KERNELS = Attachment("kernels", _attach_kernels, _detach_kernels)
SERIALIZATION = Attachment("serialization", _attach_serialization, _detach_serialization)
FOREACH_TYPES = Attachment("foreach_types", _attach_foreach_types, _detach_foreach_types)
FORWARD_HOOKS = Attachment("forward_hooks", _attach_forward_hooks, _detach_hooks)
BACKWARD_HOOKS = Attachment("backward_hooks", _attach_backward_hooks, hook_errors.detach)
CUDA_QUERIES = Attachment("cuda_queries", _attach_cuda_queries, _detach_cuda_queries)
# Note [accelerate's fp16] (accelerate_fp16.py)
ACCELERATE_FP16 = Attachment("accelerate_fp16", accelerate_fp16.attach, accelerate_fp16.detach)
MAPPED_GENERATOR = Attachment("mapped_generator", mapped_generator.attach, mapped_generator.detach)
STORAGES = Attachment("storages", storages.attach, storages.detach)  # storages.py
LEGACY_TYPES = Attachment("legacy_types", _attach_legacy_types, _detach_legacy_types)
META_PARAMETERS = Attachment(
    "meta_parameters", _attach_meta_parameters, lambda handle: handle.remove()
)
RECORDING_HOOKS = Attachment("recording_hooks", _attach_recording_hooks, _detach_hooks)
# Note [dynamo skips djinn] (dynamo_skip.py)
DYNAMO_SKIP = Attachment("dynamo_skip", dynamo_skip.attach, dynamo_skip.detach)
# Note [torch.compile and remote values] (compile_remote.py)
COMPILE_REMOTE = Attachment("compile_remote", compile_remote.attach, compile_remote.detach)
ALL = (
    BACKEND,
    KERNELS,
    SERIALIZATION,
    FOREACH_TYPES,
    FORWARD_HOOKS,
    BACKWARD_HOOKS,
    CUDA_QUERIES,
    ACCELERATE_FP16,
    MAPPED_GENERATOR,
    STORAGES,
    LEGACY_TYPES,
    META_PARAMETERS,
    RECORDING_HOOKS,
    DYNAMO_SKIP,
    COMPILE_REMOTE,
)
_DEVICE = (  # `import djinn`
    BACKEND,
    KERNELS,
    SERIALIZATION,
    FOREACH_TYPES,
    BACKWARD_HOOKS,
    STORAGES,
    DYNAMO_SKIP,
    COMPILE_REMOTE,
)
_registered = False


def register() -> None:
    """Make ``remote_accelerator[:i]`` a legal device and route its work to Djinn (what
    ``import djinn`` does, once per process)."""
    global _registered
    with _lock:
        if not _registered:
            for attachment in _DEVICE:
                attachment.acquire()
            _registered = True


def unregister() -> None:
    """Undo ``register()``: PyTorch behaves as before, remote tensors stop working."""
    global _registered
    with _lock:
        if _registered:
            for attachment in reversed(_DEVICE):
                attachment.release()
            _registered = False


def device(index: int = 0) -> torch.device:
    """``torch.device("remote_accelerator", index)``."""
    register()
    return torch.device(DEVICE_TYPE, index)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters created on this thread inside the block are on ``meta``; buffers stay
    real (they are small and often not in checkpoints)."""
    with META_PARAMETERS.held():
        _meta_local.depth = getattr(_meta_local, "depth", 0) + 1
        try:
            yield
        finally:
            _meta_local.depth -= 1


@contextlib.contextmanager
def watching(watcher: Any) -> Iterator[None]:
    """While a replayable function records: every module forward and optimizer step, on
    any thread, is told to ``watcher`` (``module_ran(m)``; ``stepped(opt, with_args)``
    as a step begins, ``step_done(opt)`` as it ends)."""
    with RECORDING_HOOKS.held():
        with _lock:
            _watchers.append(watcher)
        try:
            yield
        finally:
            with _lock:
                _watchers.remove(watcher)
