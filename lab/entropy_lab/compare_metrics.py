"""What :mod:`.compare` and :mod:`.compare_report` share: the evaluated K values and the dH correlation.

Kept apart so that the report does not import the runner (and the runner can import the report at the top).
"""

from __future__ import annotations

from entropy_discriminator.demo.train import pearson

#: The K of Pass@K in the tables (the plots show every K up to ``eval_samples``).
EVAL_KS = (1, 4, 16, 64)


def dh_correlation(pairs: list[tuple[float, float]]) -> float:
    """Pearson correlation of predicted and realised entropy changes over an arm's mini-batch steps."""
    return pearson([p for p, _ in pairs], [r for _, r in pairs])
