"""Argument validation shared by the core modules: every error names the argument at fault.  Arguments raise at
once; bad data (NaN, non-0/1 masks) is counted by :class:`DataChecks` and read with the call's first reduction.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction

import numpy as np
import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def require_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_finite(name: str, values: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``values`` (restricted to ``where``) holds NaN or inf (one host sync)."""
    bad = ~torch.isfinite(values)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        raise ValueError(f"{name} contains NaN or inf at {int(bad.sum())} valid position(s)")


def require_float(name: str, value: object) -> torch.Tensor:
    """A floating tensor (bf16, fp16, fp32 or fp64)."""
    t = require_tensor(name, value)
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a bf16/fp16/fp32/fp64 tensor, got dtype {t.dtype}")
    return t


def _scalar(value: object) -> object:
    """The Python scalar inside a 0-d torch tensor or 0-d numpy array; other values unchanged."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        return value.item()
    return value


def _real_wanted(finite: bool, minimum: float | None, above: float | None, maximum: float | None) -> str:
    """What :func:`real_number` asked for, in words (built only for an error message)."""
    bounds = [f"{op} {x:g}" for op, x in ((">=", minimum), (">", above), ("<=", maximum)) if x is not None]
    return " ".join(["a finite real number" if finite else "a real number (inf allowed)", *bounds])


def real_number(name: str, value: object, *, finite: bool = True, minimum: float | None = None,
                above: float | None = None, maximum: float | None = None) -> float:
    """``value`` (a real number, numpy scalar or 0-d real tensor / array; not ``bool``, NaN nor, with ``finite``,
    ``±inf``) as a float with ``minimum <= value``, ``above < value``, ``value <= maximum``, else ``ValueError`` /
    ``TypeError`` naming ``name``."""
    if type(value) is float:  # the common case: no 0-d tensor or array to unwrap
        x = value
    else:
        x = _scalar(value)
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
            raise TypeError(f"{name} must be {_real_wanted(finite, minimum, above, maximum)}, got {value!r} "
                            f"({type(value).__name__})")
        x = float(x)
    ok = not math.isnan(x) and (math.isfinite(x) or not finite)
    ok = ok and (minimum is None or x >= minimum) and (above is None or x > above) and (maximum is None or x <= maximum)
    if not ok:
        raise ValueError(f"{name} must be {_real_wanted(finite, minimum, above, maximum)}, got {value!r}")
    return x


def _int_wanted(minimum: int | None) -> str:
    return "an integer" + (f" >= {minimum}" if minimum is not None else "")


def integer(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (ints, numpy integers, 0-d integer tensors), else an error naming ``name``."""
    x = value if type(value) is int else _scalar(value)  # bool is not int's type: it is refused below
    if type(x) is not int and (isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral)):
        raise TypeError(f"{name} must be {_int_wanted(minimum)}, got {value!r} ({type(value).__name__})")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be {_int_wanted(minimum)}, got {value!r}")
    return int(x)


#: ``ignore_index=None`` (no position ignored) as an int: int64's minimum, which no label in [0, V) equals.
NO_IGNORE_INDEX = -(2**63)


def ignore_index_value(value: object) -> int:
    """``ignore_index`` as a Python int for the kernels: an integer, or None as :data:`NO_IGNORE_INDEX`."""
    return NO_IGNORE_INDEX if value is None else integer("ignore_index", value)


def one_of(name: str, value: object, options: Sequence[str]) -> str:
    """``value`` if it is one of the string ``options``, else ``ValueError`` naming ``name``."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'mu_low'?"`` naming the closest of ``known`` to a misspelt ``name`` (``""`` if none)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def exact_fraction(value: object) -> Fraction:
    """The decimal a finite real number was written as, ``exact_fraction(99.9) == Fraction(999, 10)`` (floats,
    ``np.float32`` and 0-d tensors: their shortest round-tripping decimal in their own precision)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, np.ndarray):
        value = value[()]
    if isinstance(value, numbers.Rational):
        return Fraction(value)
    if isinstance(value, np.floating):
        return Fraction(str(value))
    return Fraction(repr(float(value)))


def require_shape(name: str, value: torch.Tensor, shape: torch.Size, ref: str) -> torch.Tensor:
    """``value`` if its shape is ``shape`` (the shape of argument ``ref``), else ``ValueError``."""
    if value.shape != shape:
        raise ValueError(f"{name} must have {ref}'s shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def common_shape(**tensors: torch.Tensor) -> torch.Size:
    """The broadcast shape of the named tensors, or ``ValueError`` naming each with its shape."""
    try:
        return torch.broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())
        raise ValueError(f"shapes do not broadcast: {shapes}") from None


def real_or_tensor(name: str, value: object, shape: torch.Size, ref: str) -> torch.Tensor | float:
    """A real number (float) or a real tensor broadcasting to ``shape`` (the shape of ``ref``) without enlarging it."""
    if not (isinstance(value, torch.Tensor) and value.dim() > 0):
        return real_number(name, value)
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise TypeError(f"{name} must be a real number or a real tensor, got dtype {value.dtype}")
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to {ref}'s shape {tuple(shape)} "
                         "(leading dimensions align on the right: per-row values need a trailing 1, e.g. x[:, None])")
    return value


def valid_mask(valid: object, shape: torch.Size, checks: DataChecks, name: str = "valid") -> torch.Tensor:
    """``valid`` (bool, or numeric 0/1) as a bool tensor of ``shape``; non-0/1 entries are counted in ``checks``
    (one check is always added)."""
    t = require_tensor(name, valid)
    if t.shape != shape:
        raise ValueError(f"{name} must have the scores' shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype.is_complex:
        raise TypeError(f"{name} must be a bool or 0/1 tensor, got dtype {t.dtype}")
    as_bool = t if t.dtype == torch.bool else t != 0
    checks.count(f"{name} must hold only 0 and 1 (or be a bool tensor); other values at {{}} position(s)",
                 (as_bool & (t != 1)).sum())
    return as_bool


def valid_within(valid: object, within: torch.Tensor | None) -> object:
    """``valid`` (its dtype kept) set to 0 outside the bool tensor ``within`` (a ``TokenStats``' ``valid``; None:
    ``valid`` unchanged)."""
    if within is None:
        return valid
    t = require_tensor("valid", valid)
    require_shape("valid", t, within.shape, "stats.valid")
    return torch.where(within.to(t.device), t, torch.zeros((), dtype=t.dtype, device=t.device))


def as_valid_mask(valid: object, shape: torch.Size, name: str = "valid") -> torch.Tensor:
    """:func:`valid_mask` checked at once (one host synchronisation for a numeric mask)."""
    checks = DataChecks()
    mask = valid_mask(valid, shape, checks, name)
    checks.verdict(torch.stack(checks.witnesses()).tolist())
    return mask


def broadcast_advantages(advantages: object, shape: torch.Size) -> torch.Tensor:
    """Float64 advantages of ``shape`` from per-sequence ``[B]`` (``B == shape[0]``) or per-token ``advantages``."""
    a = require_tensor("advantages", advantages)
    if a.dtype == torch.bool or a.dtype.is_complex:
        raise TypeError(f"advantages must be a real tensor, got dtype {a.dtype}")
    if a.shape == shape:
        return a.to(torch.float64)
    if a.dim() == 1 and len(shape) >= 1 and a.shape[0] == shape[0]:
        return a.to(torch.float64).reshape((shape[0],) + (1,) * (len(shape) - 1)).expand(shape)
    raise ValueError(f"advantages must be per sequence [B] with B = {shape[0] if len(shape) else '?'} or per token "
                     f"with the scores' shape {tuple(shape)}, got {tuple(a.shape)}")


class DataChecks:
    """Checks of the data (NaN / inf, 0/1 masks) whose verdict rides on the call's first reduction.

    Each check adds one float64 0-d *witness* to the payload: a sum over the valid positions (non-finite when a value
    is) or a count of bad entries.  Only when a reduced witness is not clean does every rank count the bad entries
    exactly and raise the same ``ValueError``, naming the first offender with its global count.
    """

    def __init__(self) -> None:
        self._checks: list[tuple[str, torch.Tensor, bool, Callable[[], torch.Tensor]]] = []

    def finite(self, name: str, values: torch.Tensor, where: torch.Tensor, witness: torch.Tensor | None = None) -> None:
        """Check ``values`` for NaN / inf at ``where`` (``witness``: its float64 masked sum, if already computed)."""
        if witness is None:
            witness = torch.where(where, values.to(torch.float64), 0.0).sum()
        recount = lambda: (~torch.isfinite(values) & where).sum()  # noqa: E731
        self._checks.append((f"{name} contains NaN or inf at {{}} valid position(s)", witness, True, recount))

    def count(self, message: str, n: torch.Tensor) -> None:
        """A 0-d count of bad entries (non-zero fails); ``message`` has one ``{}`` for it."""
        self._checks.append((message, n, False, lambda: n))

    def witnesses(self) -> list[torch.Tensor]:
        """The float64 0-d witnesses, in order, for the payload of the reduction."""
        return [w.to(torch.float64) for _, w, _, _ in self._checks]

    def verdict(self, reduced: Sequence[float], group: object = None) -> None:
        """Raise ``ValueError`` for the first failed check, given the reduced witnesses."""
        clean = [math.isfinite(w) if is_sum else w == 0 for (_, _, is_sum, _), w in zip(self._checks, reduced)]
        if all(clean):
            return
        from .distributed import all_reduce  # the exact counts: only on this error path

        counts = torch.stack([recount().to(torch.float64) for _, _, _, recount in self._checks])
        for (message, _, _, _), n in zip(self._checks, all_reduce(counts, group).tolist()):
            if n:
                raise ValueError(message.format(int(n)))
