"""The GPU launch's rollout engine stand-in (``tests/gpu/openrlhf_site/vllm``: OpenRLHF's vLLM engine generating with
Hugging Face), on a CPU: sampling rule, KV-cache loop, sleep state, weight loading, and OpenRLHF's own
``SingleTurnAgentExecutor`` driving it with a reward function.

The stand-in is loaded under a private module name, so the tests' ``vllm`` stand-in (``test_openrlhf.py``) and
every other module stay as they are.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from test_openrlhf import Actor  # noqa: E402,F401  (skips or fails like it without OpenRLHF)

from launch_assets import write_model  # noqa: E402

SITE = HERE.parents[1] / "gpu" / "openrlhf_site"
WORKER_WRAP = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"


def _load_stand_in():
    spec = importlib.util.spec_from_file_location("ed_vllm_stand_in", SITE / "vllm" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


V = _load_stand_in()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("standin") / "model")


@pytest.fixture()
def engine(model_dir):
    return V.AsyncLLMEngine.from_engine_args(V.AsyncEngineArgs(
        model=str(model_dir), dtype="float32", seed=3, max_model_len=96, worker_extension_cls=WORKER_WRAP))


def _generate(engine, ids, params):
    async def run():
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id="r"):
            final = out
        return final

    return asyncio.run(run())


def test_sampled_logprobs_are_the_full_forward_s_and_lengths_follow_the_params(engine):
    ids = engine.tokenizer("Tom has 3 apples", add_special_tokens=False)["input_ids"]
    out = _generate(engine, ids, V.SamplingParams(temperature=0.8, max_tokens=12, min_tokens=12, logprobs=1)).outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"  # EOS excluded before min_tokens
    full = torch.tensor([ids + out.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=full).logits[0, len(ids) - 1:-1].float() / 0.8
    logits[:, sorted(engine.eos)] = -float("inf")  # processed log-probs: EOS is excluded before min_tokens
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # the KV-cache loop scores what it sampled
    greedy = _generate(engine, ids, V.SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)).outputs[0]
    top1 = _generate(engine, ids, V.SamplingParams(temperature=1.0, top_k=1, max_tokens=6, min_tokens=6)).outputs[0]
    assert greedy.token_ids == top1.token_ids and greedy.logprobs is None


def test_top_p_and_top_k_keep_the_documented_sets(engine):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {engine._draw(logits.clone(), V.SamplingParams(top_p=0.6))[0] for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 < 0.6, so the second token is needed; 0.5 + 0.3 >= 0.6 stops there
    drawn = {engine._draw(logits.clone(), V.SamplingParams(top_k=3))[0] for _ in range(400)}
    assert drawn == {0, 1, 2}
    token, logprob = engine._draw(logits.clone(), V.SamplingParams(top_p=0.6))
    assert logprob == pytest.approx(float(torch.log(torch.tensor([0.5, 0.3])[token] / 0.8)), rel=1e-5)
    with pytest.raises(ValueError, match="top_p"):
        V.SamplingParams(top_p=0.0)


def test_sleep_state_guards_generation_and_weight_loading(engine):
    ids = [5, 6, 7]
    asyncio.run(engine.sleep(level=1))
    assert asyncio.run(engine.is_sleeping()) and next(engine.model.parameters()).device.type == "cpu"
    with pytest.raises(RuntimeError, match="sleeps"):
        _generate(engine, ids, V.SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="asleep"):
        asyncio.run(engine.collective_rpc("update_weight_cuda_ipc", args=("x",)))
    asyncio.run(engine.wake_up(tags=["weights"]))
    with pytest.raises(RuntimeError, match="sleeps"):  # the KV cache still sleeps
        _generate(engine, ids, V.SamplingParams(max_tokens=2))
    asyncio.run(engine.wake_up(tags=["kv_cache"]))
    assert len(_generate(engine, ids, V.SamplingParams(max_tokens=2, min_tokens=2)).outputs[0].token_ids) == 2
    assert engine.calls[-3:] == ["sleep", "wake_up", "generate"]  # the order, consecutive repeats once


def test_weights_load_by_name_through_openrlhf_s_worker_extension(engine):
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    assert isinstance(engine.worker, WorkerWrap) and engine.worker.model_config.dtype == torch.float32
    name, param = next(iter(engine.model.named_parameters()))
    engine.worker.model_runner.model.load_weights(weights=[(name, torch.full_like(param, 0.25))])
    assert torch.all(dict(engine.model.named_parameters())[name] == 0.25)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.worker.model_runner.model.load_weights(weights=[("nope", param)])
    with pytest.raises(ValueError, match="shape"):
        engine.worker.model_runner.model.load_weights(weights=[(name, param.flatten()[:3])])


def test_openrlhf_s_single_turn_executor_drives_it(engine, tmp_path):
    """OpenRLHF's executor: tokenises the prompt, generates through the engine, scores with the reward function."""
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    reward = tmp_path / "reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n"
                      "    return {'rewards': float(len(queries[0])), 'scores': 1.0, 'extra_logs': {}}\n")
    executor = SingleTurnAgentExecutor(str(reward))

    class Rollout:  # what RolloutRayActor.generate does with the engine
        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            final = None
            async for out in engine.generate({"prompt_token_ids": prompt_token_ids}, sampling_params, "id"):
                final = out
            return final

    params = V.SamplingParams(temperature=1.0, max_tokens=8, min_tokens=1, skip_special_tokens=False, logprobs=1)
    out = asyncio.run(executor.execute(prompt="Tom has 3 apples", label="3", sampling_params=params, max_length=64,
                                       hf_tokenizer=engine.tokenizer, llm_engine=Rollout()))
    prompt_ids = engine.tokenizer("Tom has 3 apples", add_special_tokens=False)["input_ids"]
    (start, end), = out["action_ranges"]
    assert out["observation_tokens"][:start] == prompt_ids and 1 <= end - start <= 8
    assert out["reward"] == float(len(engine.tokenizer.decode(out["observation_tokens"], skip_special_tokens=False)))
    assert len(out["rollout_log_probs"]) == end and all(lp <= 0 for lp in out["rollout_log_probs"][start:])


_SYNC_PEER = """
import runpy, sys, torch
site, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
group = runpy.run_path(site + "/vllm/distributed/utils.py")["StatelessProcessGroup"].create("127.0.0.1", port, rank, 2)
comm = runpy.run_path(site + "/vllm/distributed/device_communicators/pynccl.py")["PyNcclCommunicator"](group, "cpu")
torch.manual_seed(0)
sent = torch.randn(3, 5).to(torch.bfloat16)
got = sent.clone() if rank == 0 else torch.zeros(3, 5, dtype=torch.bfloat16)
comm.broadcast(got, src=0, stream=None)
print("equal" if torch.equal(got, sent) else "differ")
"""


def test_weight_sync_group_without_cuda_ipc_broadcasts_bit_for_bit():
    """``--weight-sync gloo``: the stand-in ``StatelessProcessGroup`` / ``PyNcclCommunicator`` that OpenRLHF's
    ``stateless_init_process_group`` builds on both sides, two processes, a bf16 tensor."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peers = [subprocess.Popen([sys.executable, "-c", _SYNC_PEER, str(SITE), str(port), str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in peers]
    assert [o.strip() for o, _ in outs] == ["equal", "equal"], outs
