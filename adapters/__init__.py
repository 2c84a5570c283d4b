"""Framework adapters: ``entropy_discriminator.adapters.verl``, ``.trl``, ``.openrlhf``.

Each is imported on demand and imports its framework only then; the core never imports them.
"""
