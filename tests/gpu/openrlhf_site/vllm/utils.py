"""TEST STAND-IN (see ``vllm/__init__.py``): ``random_uuid``, a request id."""

import uuid


def random_uuid() -> str:
    return uuid.uuid4().hex
