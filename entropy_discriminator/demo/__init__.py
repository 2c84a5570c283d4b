"""The ``entropy-discriminator demo``: a small transformer, an embedded verifiable task and GRPO with and without
entropy-discriminator clipping.  Its warm-up and GRPO step (:mod:`.train`) are also the training loop of the research
harness (the ``entropy_lab`` package in the repository's ``lab/`` folder)."""
