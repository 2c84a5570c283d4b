"""TEST STAND-IN (see ``flash_attn/__init__.py``): the name OpenRLHF imports; it raises when called."""

from flash_attn import _unavailable

all_gather = _unavailable("utils.distributed.all_gather")
