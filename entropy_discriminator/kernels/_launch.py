"""Direct launches of an already compiled Triton kernel: ``kernel[grid](*args)`` re-derives on every call what only
changes with the arguments' *classes* (H100: 71-136 us of host time for the public statistics call, 48-93 us
through this path).  :class:`DirectLauncher` keys its own cache by those classes; only for the Triton releases of
:data:`SUPPORTED`, kernels without annotated parameters, and never while a launch or pre-run hook is installed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import triton

from . import interpreting

#: Triton (major, minor) releases whose ``CompiledKernel.run`` takes
#: ``(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``.
SUPPORTED = ((3, 6),)
_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
_MAX_ENTRIES = 4096


def _key_source(kinds: str, params: list) -> str:
    """Source of ``key(args, consts, num_warps, device, runtime, compilation)`` with what Triton specialises on: a
    pointer's dtype and 16-byte alignment, an integer's type, == 1, % 16 == 0 and width, a float's type (honouring
    ``do_not_specialize`` and ``do_not_specialize_on_alignment``)."""
    names = [f"a{i}" for i in range(len(kinds))]
    parts = []
    for a, kind, p in zip(names, kinds, params):
        fits = f"-2147483648 <= {a} < 2147483648, -9223372036854775808 <= {a} < 9223372036854775808"
        if kind == "p":
            parts.append(f"{a}.dtype" if p.do_not_specialize_on_alignment else f"{a}.dtype, {a}.data_ptr() % 16 == 0")
        elif kind == "i":
            parts.append(f"type({a}), {fits}" if p.do_not_specialize else f"type({a}), {a} == 1, {a} % 16 == 0, {fits}")
        elif kind == "f":
            parts.append(f"type({a})")
        else:
            raise ValueError(f"argument kinds are 'p' (pointer), 'i' (int) or 'f' (float), got {kind!r}")
    unpack = f"    {', '.join(names)}, = args\n" if names else ""
    return (
        "def key(args, consts, num_warps, device, runtime, compilation):\n" + unpack +
        f"    return ({', '.join(parts)}{',' if parts else ''} consts, num_warps, device,"
        " runtime.debug, compilation.instrumentation_mode)\n"
    )  # fmt: skip


def _hooks_installed() -> bool:
    """A launch hook is installed (Triton 3.6 keeps them in always-present, possibly empty ``HookChain`` s)."""
    hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class DirectLauncher:
    """Launch ``fn`` (a ``triton.jit`` function) with ``launch(grid, args, consts, num_warps, device)``.

    ``kinds`` declares the runtime parameters in order (``"p"`` pointer, ``"i"`` integer, ``"f"`` float); ``consts``
    holds the ``(name, value)`` of the compile-time ones, in parameter order.  Same effect, bits and errors as
    ``fn[grid](*args, **dict(consts), num_warps=num_warps)``, which it calls on a miss or when not safe.
    """

    def __init__(self, fn, kinds: str) -> None:
        self.fn = fn
        self._compiled: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        params = getattr(fn, "params", [])  # Triton's interpreter wraps the function without them
        runtime = [p for p in params if not p.is_constexpr]
        if params and len(kinds) != len(runtime):
            raise ValueError(f"{len(runtime)} runtime parameters but {len(kinds)} kinds")
        self.enabled = bool(params) and _TRITON in SUPPORTED and not interpreting()
        self.enabled = self.enabled and not any(p.annotation_type for p in params)
        self._const_names = tuple(p.name for p in params if p.is_constexpr)
        namespace: dict = {}
        exec(_key_source(kinds if params else "", runtime), namespace)
        self._key = namespace["key"]

    def key(self, args: Sequence[object], consts: tuple, num_warps: int, device: int) -> tuple:
        """The cache key of one launch (:func:`_key_source`)."""
        return self._key(args, consts, num_warps, device, triton.knobs.runtime, triton.knobs.compilation)

    def launch(
        self, grid: tuple[int, int, int], args: Sequence[object], consts: tuple, num_warps: int, device: int
    ) -> None:
        """One launch on ``device``'s (the current CUDA device's) current stream."""
        direct = self.enabled and not self.fn.pre_run_hooks and not _hooks_installed()
        if direct:
            try:
                key = self.key(args, consts, num_warps, device)
            except Exception:  # an argument not of its declared kind: Triton's own path decides
                key, direct = None, False
            entry = self._compiled.get(key)
            if entry is not None:
                kernel, const_values = entry
                stream = torch._C._cuda_getCurrentRawStream(device)
                kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                           *args, *const_values)  # fmt: skip
                return
        kernel = self.fn[grid](*args, **dict(consts), num_warps=num_warps)
        if direct and kernel is not None and not hasattr(kernel, "result"):  # compiled, not a pending compilation
            if tuple(n for n, _ in consts) != self._const_names:  # Triton accepted them as keywords: any order
                return
            with self._lock:
                if len(self._compiled) >= _MAX_ENTRIES:
                    self._compiled.clear()
                self._compiled[key] = (kernel, tuple(v for _, v in consts))

    def clear(self) -> None:
        """Forget every compiled kernel (the next call of each class goes through Triton again)."""
        with self._lock:
            self._compiled.clear()
