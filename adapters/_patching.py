"""Idempotent, reversible patches of other frameworks, with version guards (used by every adapter).

A :class:`PatchSet` records each attribute it replaces exactly as it found it (present in the
owner's own ``__dict__`` or inherited), so :meth:`PatchSet.restore` puts every owner back in its
original state, in reverse order.  :func:`require_version` refuses a framework release outside the
range an adapter was written and tested against, saying why.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

_MISSING = object()


class UnsupportedVersionError(RuntimeError):
    """The installed framework release is outside the adapter's supported range."""


def require_version(distribution: str, spec: str, *, why: str, installed: str | None = None) -> str:
    """Return the installed version of ``distribution`` if it satisfies the PEP 440 ``spec``.

    ``spec`` is one specifier set such as ``">=1.16.0,<1.17.0"``, compared as versions, not as
    strings or number tuples: a pre-release or development build below the floor
    (``1.16.0.dev0``, ``1.16.0rc1``) is refused, and so is a pre-release of the excluded upper
    bound (``1.17.0rc1``).  Raises :class:`UnsupportedVersionError` naming the package, the
    installed and supported versions and ``why`` the range matters (e.g. which private function
    the adapter patches).  ``installed`` overrides the metadata lookup (for tests and vendored
    copies).
    """
    specifier = SpecifierSet(spec)
    if installed is None:
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError as exc:
            raise UnsupportedVersionError(f"{distribution} is not installed; this adapter needs {distribution}{spec}") from exc
    try:
        version = Version(installed)
    except InvalidVersion as exc:
        raise UnsupportedVersionError(f"{distribution} reports version {installed!r}, which is not a PEP 440 version") from exc
    if not specifier.contains(version, prereleases=True):
        raise UnsupportedVersionError(
            f"{distribution} {installed} is not supported: this adapter supports {distribution}{spec} "
            f"because {why}. Install a supported version, e.g. pip install '{distribution}{spec}'."
        )
    return installed


class PatchSet:
    """A named group of attribute replacements that can be applied once and undone exactly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        """True while at least one replacement is in place."""
        return bool(self._saved)

    def replace(self, owner: Any, attribute: str, new: Any) -> Any:
        """Set ``owner.attribute = new``; return what ``getattr(owner, attribute)`` gave before.

        The owner's own ``__dict__`` entry (or its absence, for an inherited attribute) is
        remembered, so :meth:`restore` deletes what was inherited instead of pinning a copy.
        """
        if any(o is owner and a == attribute for o, a, _ in self._saved):
            raise RuntimeError(f"{self.name}: {owner!r}.{attribute} is already patched")
        own = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, attribute, _MISSING)
        before = getattr(owner, attribute)
        self._saved.append((owner, attribute, own))
        setattr(owner, attribute, new)
        return before

    def restore(self) -> None:
        """Undo every replacement, last first. Calling it when nothing is patched does nothing."""
        while self._saved:
            owner, attribute, own = self._saved.pop()
            if own is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
