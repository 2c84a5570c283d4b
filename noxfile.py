"""Test sessions, one virtual environment per framework.

verl 0.9.1, TRL 1.16.0 and OpenRLHF 0.11.2 pin different transformers versions, so each adapter
is tested in an environment of its own.  ``nox`` with no arguments runs every session; this is the
README's test command and what ``.ci/run`` executes.

``ED_TORCH_SPEC`` chooses the torch requirement installed first in every session (default:
``torch==2.13.0``, the CPU wheel the CI machine provides; a pinned version keeps pip from pulling a
different, multi-GB build through a framework's loose requirement).
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["core", "verl", "trl", "openrlhf"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("ED_TORCH_SPEC", "torch==2.13.0")
PYTEST = ["pytest", "-q", "-p", "no:cacheprovider"]


@nox.session
def core(session: nox.Session) -> None:
    """The framework-free core: statistics, masks, dynamics, monitor, distributed, demo, examples."""
    session.install(TORCH)
    session.install("-e", ".[test,plot]")
    session.run(*PYTEST, "tests", "--ignore=tests/adapters", *session.posargs)


@nox.session
def verl(session: nox.Session) -> None:
    """The verl 0.9.1 adapter against a real CPU install of ``verl[verl-core]==0.9.1``.

    torch is installed first and pinned again with the extra so that verl's loose ``torch``
    requirement can never pull a CUDA build.
    """
    session.install(TORCH)
    session.install("-e", ".[test,verl]", TORCH)
    session.run(*PYTEST, "tests/adapters", "-k", "verl", *session.posargs)


@nox.session
def trl(session: nox.Session) -> None:
    """The TRL 1.16.0 adapter against a real CPU install of ``trl==1.16.0``.

    torch is installed first and pinned again with the extra so that TRL's dependencies
    (accelerate, transformers) can never pull a CUDA build.  The tests build a tiny random
    causal LM and an in-memory tokenizer (no hub access) and include a 2-process gloo run.
    """
    session.install(TORCH)
    session.install("-e", ".[test,trl]", TORCH)
    session.run(*PYTEST, "tests/adapters", "-k", "trl", *session.posargs)
