"""TEST STAND-IN for flash-attn, used only by ``tests/gpu/launch_openrlhf.py`` (never by the library).

OpenRLHF 0.11 imports ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module level
(``openrlhf/models/ring_attn_utils.py``) but calls them only for packed samples and ring attention, which the GPU
launch does not use (``--ds.attn_implementation sdpa``, no ``--ds.packing_samples``).  flash-attn 2.8.3 is
published as source only and cannot be built for the device's torch; these modules satisfy that import, and every
function in them raises, so a code path that needs flash-attn fails loudly instead of computing something else.
There is no distribution metadata, so transformers reports flash-attn as unavailable.
"""

__version__ = "0.0.0+stand-in"


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"flash_attn.{name}: flash-attn is not installed (tests/gpu/openrlhf_site stand-in)")

    call.__name__ = name
    return call
