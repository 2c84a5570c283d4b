"""verl 0.9.1's critic with PyTorch's SDPA attention, for ``launch_verl.py`` (loaded through
``VERL_USE_EXTERNAL_MODULES``).

verl builds its value model (``verl.utils.model.load_valuehead_model``, called by the FSDP engine for
``critic``) with ``attn_implementation="flash_attention_2"`` written into the call, whatever the critic's
``override_config`` says, and the flash-attn package is neither on the device nor on the CPU test machines
(verl's actor honours ``override_config.attn_implementation=sdpa``). This module puts in its place a loader that
builds the same ``AutoModelForTokenClassification`` (verl's own head settings in ``model_config``) with ``sdpa``.
The engine imports the loader when it builds the critic, so replacing the module attribute reaches it.
"""

from __future__ import annotations

from typing import Any

import verl.utils.model


def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
    """verl's value model (a token-classification head with one label, as verl configures ``model_config``), SDPA
    attention."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation="sdpa", trust_remote_code=trust_remote_code)


verl.utils.model.load_valuehead_model = load_valuehead_model
