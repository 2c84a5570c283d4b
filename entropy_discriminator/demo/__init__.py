"""The ``entropy-discriminator demo``: a small transformer, an embedded verifiable task, GRPO with and without
entropy-discriminator clipping, and a small-scale reproduction of the paper's entropy-dynamics experiments."""
