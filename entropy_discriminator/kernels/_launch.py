"""Direct launches of an already compiled Triton kernel (host time of small calls).

``kernel[grid](*args)`` re-derives on every call what only changes with the arguments' *classes*:
it binds the arguments, specialises each one (dtype and 16-byte alignment of a pointer; for an
integer its width, divisibility by 16 and whether it equals 1), looks the compiled kernel up under
that key, rebuilds launch metadata for the launch hooks and only then calls the launcher.  On the
H100 machines of ``benchmarks.host_path`` that path costs 60-120 us of host time per call, more
than the statistics kernel takes at N = 256, and a call that waits for its kernel pays it in full
whenever it outlasts the GPU's previous work.

:class:`DirectLauncher` keys its own cache by the same classes (computed per argument, in the
order of the kernel's parameters, with each parameter's ``do_not_specialize`` /
``do_not_specialize_on_alignment`` flags honoured) plus the compile-time arguments, ``num_warps``,
the device and Triton's debug / instrumentation switches.  The first call of a class goes through
Triton (compiling if needed) and stores the compiled kernel; later calls pass the same positional
arguments straight to its launcher.  Used only for the Triton releases whose launcher signature this
was written against (:data:`SUPPORTED`), for kernels without annotated parameters, and never while a
launch hook (a profiler) or a pre-run hook is installed: then every call takes Triton's own path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import triton

from . import interpreting

#: Triton (major, minor) releases whose ``CompiledKernel.run`` takes
#: ``(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``.
SUPPORTED = ((3, 6),)
_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
_MAX_ENTRIES = 4096

_I32 = 2**31
_I64 = 2**63


def int_class(v: int) -> object:
    """What Triton specialises an integer argument on: 1 (compiled in as a constant), else
    (divisible by 16, fits int32, fits int64)."""
    if v == 1:
        return 1
    return (v % 16 == 0, -_I32 <= v < _I32, -_I64 <= v < _I64)


def int_width(v: int) -> object:
    """A ``do_not_specialize`` integer: only its width (int32, int64 or uint64) matters."""
    return (-_I32 <= v < _I32, -_I64 <= v < _I64)


def tensor_class(t: torch.Tensor) -> object:
    """A pointer argument: its dtype and whether its address is 16-byte aligned."""
    return (t.dtype, t.data_ptr() % 16 == 0)


def tensor_dtype(t: torch.Tensor) -> object:
    """A pointer argument marked ``do_not_specialize_on_alignment``: its dtype only."""
    return t.dtype


def arg_class(v: object, specialize: bool = True, align: bool = True) -> object:
    """The class of one runtime argument (see the module docstring); bool before int (Triton
    passes bools as ``u1``), floats are always fp32, anything else by type and value."""
    if isinstance(v, bool):
        return ("u1",)
    if isinstance(v, int):
        return int_class(v) if specialize else int_width(v)
    if isinstance(v, float):
        return ("fp32",)
    if isinstance(v, torch.Tensor):
        return tensor_class(v) if align else tensor_dtype(v)
    return (type(v), v)


def _hooks_installed() -> bool:
    """A launch hook is installed (Triton 3.6 keeps them in always-present, possibly empty ``HookChain`` s)."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class DirectLauncher:
    """Launch ``fn`` (a ``triton.jit`` function) with ``launch(grid, args, consts, num_warps, device)``.

    ``args`` are the runtime arguments in parameter order, ``consts`` the ``(name, value)`` of the
    compile-time arguments that follow them, also in parameter order.  Same effect, bits and
    errors as ``fn[grid](*args, **dict(consts), num_warps=num_warps)``, which it calls on a cache
    miss or whenever a direct launch is not safe (see the module docstring).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self._compiled: dict[tuple, object] = {}
        self._lock = threading.Lock()
        params = getattr(fn, "params", [])  # Triton's interpreter wraps the function without them
        self.enabled = bool(params) and _TRITON in SUPPORTED and not interpreting()
        self.enabled = self.enabled and not any(p.annotation_type for p in params)
        runtime = [p for p in params if not p.is_constexpr]
        self._n_runtime = len(runtime)
        self._classify: list[Callable[[object], object]] = [self._classifier(p) for p in runtime]
        self._const_names = tuple(p.name for p in params if p.is_constexpr)

    @staticmethod
    def _classifier(param) -> Callable[[object], object]:
        specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
        of_int = int_class if specialize else int_width
        of_tensor = tensor_class if align else tensor_dtype

        def classify(v: object) -> object:  # plain ints and tensors first: the common case, no isinstance chain
            t = type(v)
            if t is int:
                return of_int(v)
            if t is torch.Tensor:
                return of_tensor(v)
            return arg_class(v, specialize, align)

        return classify

    def key(self, args: Sequence[object], consts: tuple, num_warps: int, device: int) -> tuple:
        """The cache key of one launch (public for the tests)."""
        rt, comp = triton.knobs.runtime, triton.knobs.compilation
        classes = tuple([f(a) for f, a in zip(self._classify, args)])
        return (classes, consts, num_warps, device, rt.debug, comp.instrumentation_mode)

    def launch(
        self, grid: tuple[int, int, int], args: Sequence[object], consts: tuple, num_warps: int, device: int
    ) -> None:
        """One launch on ``device``'s (the current CUDA device's) current stream."""
        direct = self.enabled and not self.fn.pre_run_hooks and not _hooks_installed()
        if direct:
            if len(args) != self._n_runtime or tuple(n for n, _ in consts) != self._const_names:
                raise TypeError(f"{self.fn.__name__}: arguments do not match the kernel's parameters")
            key = self.key(args, consts, num_warps, device)
            kernel = self._compiled.get(key)
            if kernel is not None:
                stream = torch._C._cuda_getCurrentRawStream(device)
                kernel.run(
                    grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                    *args, *(v for _, v in consts),
                )  # fmt: skip
                return
        kernel = self.fn[grid](*args, **dict(consts), num_warps=num_warps)
        if direct and kernel is not None and not hasattr(kernel, "result"):  # compiled, not a pending compilation
            with self._lock:
                if len(self._compiled) >= _MAX_ENTRIES:
                    self._compiled.clear()
                self._compiled[key] = kernel

    def clear(self) -> None:
        """Forget every compiled kernel (the next call of each class goes through Triton again)."""
        with self._lock:
            self._compiled.clear()
