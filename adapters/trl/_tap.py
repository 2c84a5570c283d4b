"""Statistics from the logits tiles of TRL's own fused LM head (TRL 1.16), no second head product.

TRL 1.15+ scores completions through ``add_fused_lm_head``: ``ChunkedLogProbFunction`` forms the
logits ``[4096, 32768]`` tile by tile (``torch.mm`` in the head's compute dtype, plus the bias) and
reduces each tile with its fold (``_forward_kernel`` on Triton devices, ``_forward_tile``
elsewhere) before dropping it.  While a :class:`HeadTap` is active, every tile TRL folds is also
folded into a :class:`~entropy_discriminator.vocab_fold.VocabFold` (one more read of the tile),
so the statistics read exactly the logits TRL's log-probs read, in TRL's precision, and cost no
LM-head product of their own.

The tap relies on the fold's positional layout in the TRL 1.16 sources (``fold(tile, stride,
targets[a:b], 7 accumulators, vocab_start, n_cols, ..., logit_scale=, softcap=, inv_t=,
HAS_SOFTCAP=)``) and on ``ChunkedLogProbFunction.forward(ctx, hidden, weight, bias, targets,
temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)``; a pass it cannot read
(softcapped logits, TRL 1.14's full logits, 1.15's head without ``_forward_tile``, another layout)
leaves :meth:`HeadTap.stats` ``None`` and the caller computes the statistics from the captured
hidden states instead (one LM-head product).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from entropy_discriminator import TokenStats
from entropy_discriminator.vocab_fold import VocabFold

from ._stats import place_rows

_FORWARD_PARAMS = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                   "final_logit_softcapping", "logit_scale", "outputs")
_FOLD_HEAD = ("tile", "tile_stride", "targets")  # _forward_tile's first parameters
_VOCAB_START_ARG = 10  # fold(..., vocab_start, n_cols, ...): positional index of vocab_start


def _head_module() -> Any | None:
    """``trl.kernels.chunked_logprob`` when its layout is the one read here, else None."""
    try:
        from trl.kernels import chunked_logprob as mod
    except ImportError:
        return None
    fn = getattr(mod, "ChunkedLogProbFunction", None)
    tile = getattr(mod, "_forward_tile", None)
    if fn is None or tile is None or not hasattr(mod, "_forward_kernel") or not hasattr(mod, "_use_triton"):
        return None
    forward_params = tuple(inspect.signature(fn.forward).parameters)
    tile_params = tuple(inspect.signature(tile).parameters)
    if forward_params != _FORWARD_PARAMS or tile_params[:3] != _FOLD_HEAD or tile_params[_VOCAB_START_ARG] != "vocab_start":
        return None
    return mod


class _TappedLaunch:
    """Stands in for ``_forward_kernel`` (indexed by its grid): launches it, then the tap's fold."""

    def __init__(self, kernel: Any, tap: HeadTap) -> None:
        self.kernel, self.tap = kernel, tap

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> None:
            launch(*args, **kwargs)
            self.tap._fold(args)

        return run


class HeadTap:
    """Context manager: while active, the forwards of TRL's fused LM head also fold their tiles into
    entropy-discriminator statistics; :meth:`stats` returns them for the pass's completion tokens."""

    def __init__(self, impl: str = "auto") -> None:
        self.impl = impl
        self.mod = _head_module()
        self.calls: list[tuple[VocabFold, bool]] = []  # per head forward: its fold, compact (valid rows only)?
        self.unreadable = self.mod is None
        self._active: tuple[VocabFold, torch.Tensor] | None = None
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HeadTap:
        if self.mod is None:
            return self
        mod, fn = self.mod, self.mod.ChunkedLogProbFunction
        self._saved = {"forward": fn.__dict__["forward"], "_forward_kernel": mod._forward_kernel,
                       "_forward_tile": mod._forward_tile}
        real_forward, real_tile = fn.forward, mod._forward_tile

        def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Any, targets: torch.Tensor,
                    temperature: float, chunk_size: int, final_logit_softcapping: float | None = None,
                    logit_scale: float = 1.0, *rest: Any) -> Any:
            if final_logit_softcapping is not None:
                self.unreadable = True  # softcapped logits: not read here
            fold = VocabFold(hidden.shape[0], hidden.device, temperature=temperature, scale=logit_scale,
                             impl=self.impl)
            self._active = None if self.unreadable else (fold, targets)
            try:
                out = real_forward(ctx, hidden, weight, bias, targets, temperature, chunk_size,
                                   final_logit_softcapping, logit_scale, *rest)
            finally:
                self._active = None
            self.calls.append((fold, bool(mod._use_triton(hidden.device))))
            return out

        def tile(*args: Any, **kwargs: Any) -> None:
            real_tile(*args, **kwargs)
            self._fold(args)

        fn.forward = staticmethod(forward)
        mod._forward_kernel = _TappedLaunch(mod._forward_kernel, self)
        mod._forward_tile = tile
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._saved:
            return
        self.mod.ChunkedLogProbFunction.forward = self._saved["forward"]
        self.mod._forward_kernel = self._saved["_forward_kernel"]
        self.mod._forward_tile = self._saved["_forward_tile"]
        self._saved = {}

    def _fold(self, args: tuple) -> None:
        if self._active is None:
            return
        fold, targets = self._active
        tile, _, part_targets = args[:3]
        row_start = (part_targets.data_ptr() - targets.data_ptr()) // targets.element_size()
        fold.fold(tile, part_targets, row_start, int(args[_VOCAB_START_ARG]))

    def stats(self, valid: torch.Tensor) -> TokenStats | None:
        """Statistics ``(B, T)`` of the pass's completion tokens (``valid`` (B, T) bool: those TRL
        scored), or None when the tap could not read the pass (then nothing is claimed)."""
        if self.unreadable or not self.calls:
            return None
        parts = [fold.finish() for fold, _ in self.calls]
        fields = [torch.cat(col) if len(parts) > 1 else col[0] for col in zip(*parts)]
        rows = valid.to(device=fields[0].device, dtype=torch.bool)
        if all(compact for _, compact in self.calls):  # TRL scored the valid positions only, in row order
            if fields[0].numel() != int(rows.sum()):
                return None
        else:  # every position of (B, S - 1) was scored: the completion part is the last T columns
            batch, tokens = rows.shape
            if any(compact for _, compact in self.calls) or fields[0].numel() % batch:
                return None
            fields = [f.view(batch, -1)[:, -tokens:][rows] for f in fields]
        logp, entropy, s_star, s_expected = fields
        ones = torch.ones_like(logp, dtype=torch.bool)
        return place_rows(TokenStats(logp, entropy, s_star, s_expected, s_star - s_expected, ones), rows)
