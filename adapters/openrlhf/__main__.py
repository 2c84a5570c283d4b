"""``python -m entropy_discriminator.adapters.openrlhf``: the launcher (see :mod:`._launch`)."""

from ._launch import main

main()
