"""The HF stand-in rollout of the GPU launch (``hf_rollout.py``), on the CPU, without Ray.

Its server samples one request at a time with the model's KV cache; these tests compare what it returns
with a full forward of the same model on the whole sequence (no cache), and check the weight sync verl's
worker drives through :class:`hf_rollout.HFServerAdapter` (names and tensors in, the model's weights out).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="needs the verl extra: nox -s verl")
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import hf_rollout  # noqa: E402
from launch_assets import write_model  # noqa: E402

from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import RolloutReplicaRegistry  # noqa: E402

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_rollout")
    return write_model(root / "a", seed=0), write_model(root / "b", seed=1)


def _server(path: Path, response_length: int = 6) -> hf_rollout.HFServer:
    config = SimpleNamespace(prompt_length=8, response_length=response_length, get=lambda key, default=None: default)
    return hf_rollout.HFServer(config, str(path), replica_rank=0, cuda_visible_devices=None)


def _full_logits(server: hf_rollout.HFServer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits that predict each drawn token, from one forward over prompt + tokens (no cache), fp32."""
    with torch.no_grad():
        out = server.model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return out[len(prompt) - 1:len(prompt) + len(tokens) - 1].float()


def test_registered_in_verls_rollout_registries():
    assert RolloutReplicaRegistry.get(hf_rollout.NAME) is hf_rollout.HFReplica
    assert get_rollout_class(hf_rollout.NAME, "async") is hf_rollout.HFServerAdapter


def test_greedy_is_the_argmax_of_a_full_forward(model_dirs):
    server = _server(model_dirs[0])
    tokens, lps = server.sample(PROMPT, 6, temperature=0.0, top_k=-1, top_p=1.0, logprobs=True)
    logits = _full_logits(server, PROMPT, tokens)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), expected, rtol=0, atol=1e-5)


def test_sampled_log_probs_are_the_tempered_distributions(model_dirs):
    server = _server(model_dirs[0])
    tokens, lps = server.sample(PROMPT, 6, temperature=0.7, top_k=-1, top_p=1.0, logprobs=True)
    assert len(tokens) == 6  # the random model never draws its EOS token first here
    logits = _full_logits(server, PROMPT, tokens) / 0.7
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), expected, rtol=0, atol=1e-5)


def test_filters_keep_the_top_k_and_the_nucleus():
    z = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert torch.isfinite(hf_rollout._filtered(z, 2, 1.0)).tolist() == [True, False, True, False]
    p = torch.softmax(z, -1)  # 0.644, 0.087, 0.237, 0.032
    assert torch.isfinite(hf_rollout._filtered(z, -1, 0.7)).tolist() == [True, False, True, False]
    assert torch.isfinite(hf_rollout._filtered(z, -1, float(p[0]) - 1e-3)).tolist() == [True, False, False, False]
    assert torch.isfinite(hf_rollout._filtered(z, 0, 1.0)).all()


def test_generate_defaults_and_refusals(model_dirs):
    server = _server(model_dirs[0], response_length=4)
    out = asyncio.run(server.generate(PROMPT, {"temperature": 0.0, "logprobs": False}, request_id="r"))
    assert len(out.token_ids) == 4 and out.log_probs is None and out.extra_fields == {"global_steps": None}
    long_prompt = list(range(10))  # prompt_length 8 + response_length 4 - 10 leaves 2
    assert len(asyncio.run(server.generate(long_prompt, {"temperature": 0.0}, request_id="r")).token_ids) == 2
    with pytest.raises(ValueError, match="repetition_penalty"):
        asyncio.run(server.generate(PROMPT, {"repetition_penalty": 1.1}, request_id="r"))
    with pytest.raises(ValueError, match="multimodal"):
        asyncio.run(server.generate(PROMPT, {}, request_id="r", image_data=[object()]))


def test_weight_sync_replaces_the_model(model_dirs):
    """What verl's naive sync hands over (HF names -> tensors, here bf16 as verl's FSDP engine may send them) becomes
    the server's model; unknown or missing names are refused."""
    a, b = _server(model_dirs[0]), _server(model_dirs[1])
    tokens = [3, 1, 4, 1, 5]
    assert not torch.allclose(_full_logits(a, PROMPT, tokens), _full_logits(b, PROMPT, tokens))
    named = {k: v.to(torch.bfloat16) for k, v in b.model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert a.load_weights(named, global_steps=3) == len(named)
    for key, value in named.items():
        assert torch.equal(a.model.state_dict()[key], value.float()), key
    b.load_weights(named, global_steps=3)  # b with the same bf16-rounded weights: the same logits
    assert torch.equal(_full_logits(a, PROMPT, tokens), _full_logits(b, PROMPT, tokens))
    assert a.status()["global_steps"] == 3 and a.status()["weight_updates"] == 1
    with pytest.raises(ValueError, match="unexpected"):
        a.load_weights({**named, "model.extra.weight": torch.zeros(1)}, global_steps=4)
    with pytest.raises(ValueError, match="missing"):
        a.load_weights({k: v for k, v in named.items() if k != "model.norm.weight"}, global_steps=4)


def test_one_gpu_per_replica():
    config = SimpleNamespace(tensor_model_parallel_size=2, data_parallel_size=1, pipeline_model_parallel_size=1)
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be 1"):
        hf_rollout._single_gpu_replica(config)
