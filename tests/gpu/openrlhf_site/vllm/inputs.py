"""TEST STAND-IN (see ``vllm/__init__.py``): ``TokensPrompt``, a prompt given as token ids."""

from typing import TypedDict


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    multi_modal_data: dict
