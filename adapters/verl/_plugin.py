"""Target of the ``verl.plugins`` entry point: verl imports it on ``import verl`` in every process.

Importing it only schedules the registration of the adapter's trainer names (see
:func:`entropy_discriminator.adapters.verl.on_plugin_load`); no verl behaviour changes.
"""

from . import on_plugin_load

on_plugin_load()
