"""TEST STAND-IN (see ``vllm/__init__.py``)."""
