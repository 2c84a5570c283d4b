"""The ``entropy-discriminator demo``: a small transformer, an embedded verifiable task and GRPO with and without
entropy-discriminator clipping.  :mod:`.train`'s ``LoopConfig`` and ``warm_up`` are also what every experiment of the
research harness (the ``entropy_lab`` package in the repository's ``lab/`` folder) sizes and warms up its policy
with, and its GRPO runs (``run_arm``) are the paper reproduction's."""
