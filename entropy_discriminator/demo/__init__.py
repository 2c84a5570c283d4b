"""The ``entropy-discriminator demo`` (docs/demo.md).  The research harness (``lab/``) builds on :mod:`.train`'s
``LoopConfig``, ``warm_up`` and ``run_arm``."""
