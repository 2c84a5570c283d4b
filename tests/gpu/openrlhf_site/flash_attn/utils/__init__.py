"""TEST STAND-IN (see ``flash_attn/__init__.py``)."""
