"""Test sessions, one virtual environment per framework.

verl, TRL and OpenRLHF pin different transformers versions, so each adapter is tested in an
environment of its own, once for the oldest and once for the newest release of its supported range
(``verl(release=...)``, ``trl(...)``, ``openrlhf(release=...)``).  ``nox`` with no arguments runs every session; this is the
README's test command and what ``.ci/run`` executes.

``ED_TORCH_SPEC`` chooses the torch requirement installed first in every session (default:
``torch==2.13.0``, the CPU wheel the CI machine provides; a pinned version keeps pip from pulling a
different, multi-GB build through a framework's loose requirement).
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["core", "verl", "trl", "openrlhf", "kernels"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("ED_TORCH_SPEC", "torch==2.13.0")
PYTEST = ["pytest", "-q", "-p", "no:cacheprovider"]


@nox.session
def core(session: nox.Session) -> None:
    """The framework-free core: statistics, masks, dynamics, monitor, distributed, demo, examples, and the research
    harness (``lab/``, package ``entropy_lab``) installed after the library."""
    session.install(TORCH)
    session.install("-e", ".[test,plot]")
    session.install("--no-deps", "-e", "./lab")  # its requirements, the library and torch, are the lines above
    session.run(*PYTEST, "tests", "--ignore=tests/adapters", *session.posargs)


#: Oldest and newest verl release of the adapter's range (adapters/verl/_support.py: SUPPORTED_VERL).
VERL_RELEASES = ["0.9.0", "0.9.1"]
#: What verl 0.9.0's V1 trainer imports but its metadata does not require (0.9.1's verl-core extra does).
VERL_090_MISSING = ["cachetools", "fastapi", "uvicorn"]


@nox.session
@nox.parametrize("release", VERL_RELEASES)
def verl(session: nox.Session, release: str) -> None:
    """The verl adapter against a real CPU install of ``verl[verl-core]`` (oldest and newest supported release),
    including the example launches through verl's ``main_ppo`` into its Ray workers (test_verl_launch.py).

    torch is installed first and pinned again with verl so that verl's loose ``torch``
    requirement can never pull a CUDA build.  verl 0.9.0 has no ``verl-core`` extra; the
    project's ``verl`` extra adds the TransferQueue its V1 trainer imports.
    """
    session.install(TORCH)
    session.install("-e", ".[test,verl]", f"verl[verl-core]=={release}", TORCH)
    if release == "0.9.0":
        session.install(*VERL_090_MISSING)
    else:  # the Megatron hook's CPU (gloo) tests run against the newest release; no TransformerEngine
        session.install("megatron-core==0.16.1", TORCH)
    session.run(*PYTEST, "tests/adapters/verl", *session.posargs, env={"ED_VERL_RELEASE": release})


# TRL: the oldest and the newest release of the adapter's range (adapters/trl/_support.py SUPPORTED_TRL),
# each with its own pins (TRL 1.14 imports requests without declaring it).
TRL_RELEASES = {"1.14.0": ["transformers==5.24.0", "requests"], "1.16.0": ["transformers==5.24.0"]}


@nox.session
@nox.parametrize("release", list(TRL_RELEASES), ids=["1.14", "1.16"])
def trl(session: nox.Session, release: str) -> None:
    """The TRL adapter against a real CPU install of the oldest and the newest supported TRL.

    torch is installed first and pinned again with TRL so that its dependencies (accelerate,
    transformers) can never pull a CUDA build.  The tests build a tiny random causal LM and an
    in-memory tokenizer (no hub access) and include a 2-process gloo run.
    """
    session.install(TORCH)
    session.install("-e", ".[test]", f"trl=={release}", *TRL_RELEASES[release], TORCH)
    session.install("--no-deps", "-e", "./lab")  # the head-to-head's TRL path (test_headtohead_trl.py) is the lab's
    # Only the TRL test files: collecting another adapter's tests can put stub modules (e.g. vllm)
    # into sys.modules, which TRL's import-time feature checks then trip over.
    # ED_REQUIRE_TRL: the TRL tests fail instead of skipping when trl cannot be imported here.
    session.run(*PYTEST, "tests/adapters/trl", *session.posargs, env={"ED_REQUIRE_TRL": "1"})


# OpenRLHF as far as a CPU allows: the package without its requirements (flash-attn 2.8.3 is
# source-only and needs CUDA; vllm is GPU-only), plus what its model, loss, replay-buffer and
# Ray-trainer modules import, pinned as each release pins them (datasets: the launch test's
# PPOTrainer loads its prompts through it). The tests stand in for flash_attn, ring_flash_attn and
# vllm, and list them. The oldest and the newest supported release are tested.
OPENRLHF_RELEASES = {
    "0.10.2": ["transformers==5.5.4", "ray==2.48.0", "deepspeed==0.18.9"],
    "0.11.2": ["transformers==5.15.0", "ray==2.55.0", "deepspeed==0.19.6"],
}
OPENRLHF_CPU_DEPS = ["peft", "torchdata", "pylatexenc", "aiohttp", "pillow", "tqdm", "einops", "datasets"]


@nox.session
@nox.parametrize("release", list(OPENRLHF_RELEASES))
def openrlhf(session: nox.Session, release: str) -> None:
    """The OpenRLHF adapter against the real OpenRLHF modules on a CPU (oldest and newest release).

    deepspeed (imported by OpenRLHF's trainer) is an sdist: built without build isolation against
    the pinned CPU torch, no ops compiled.  The tests run a tiny random Llama through the patched
    ``ActorPPOTrainer.ppo_train`` (configuration matrix), a local Ray cluster, 2-process gloo runs, and
    the example launches through the adapter's launcher into OpenRLHF's policy actor
    (test_openrlhf_launch.py).
    """
    *pins, deepspeed = OPENRLHF_RELEASES[release]
    session.install(TORCH, "setuptools", "wheel")
    session.install("-e", ".[test]", TORCH)
    session.install("--no-deps", f"openrlhf=={release}")
    session.install(TORCH, *pins, *OPENRLHF_CPU_DEPS)
    session.install("--no-build-isolation", TORCH, deepspeed)
    # ED_REQUIRE_OPENRLHF: the tests fail instead of skipping when openrlhf cannot be imported here.
    env = {"ED_REQUIRE_OPENRLHF": "1", "ED_OPENRLHF_RELEASE": release}
    session.run(*PYTEST, "tests/adapters/openrlhf", *session.posargs, env=env)


# --- kernels session (owner: kernel engineer) ---
@nox.session
def kernels(session: nox.Session) -> None:
    """The Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

    Same kernel code as on a GPU, executed by numpy; numpy < 2.4 because Triton 3.6's interpreter
    converts 1-element arrays to Python ints, which numpy 2.4 refuses.  Compiled-kernel checks at
    full size are in tests/gpu/ (``pytest -m gpu`` on a CUDA machine).
    """
    session.install(TORCH)
    session.install("-e", ".[test]", TORCH, "triton==3.6.0", "numpy<2.4")
    session.run(*PYTEST, "tests/test_kernels.py", "tests/test_deferred.py", *session.posargs, env={"TRITON_INTERPRET": "1"})
