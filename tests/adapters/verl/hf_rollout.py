"""A rollout that generates with plain HF ``transformers``, for verl 0.9.1's V1 trainer (tests only).

verl's V1 trainer knows the rollout back-ends vLLM, SGLang and TensorRT-LLM; none can be installed on
the test machines.  This module stands in for them through verl's own extension points, so that
``python -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.name=hf`` runs verl's real trainer,
agent loop, reward loop, Ray workers and FSDP engine unchanged, with generation done here:

* ``RolloutReplicaRegistry.register("hf", ...)``: the trainer's ``LLMServerManager`` (TaskRunner
  process) builds :class:`HFReplica`, which starts one :class:`HFServer` Ray actor per replica, on the
  node and GPU of the training worker it is colocated with (verl's hybrid mode, as its vLLM replica);
* ``verl.workers.rollout.base._ROLLOUT_REGISTRY[("hf", "async")]``: the actor worker's
  ``init_model`` builds :class:`HFServerAdapter`, through which verl's naive weight sync
  (``ActorRolloutRefWorker.update_weights``) hands the trained weights, by HF parameter name, to the
  replica's server after every step.

verl imports this module in every process of a launch when it is named in ``VERL_USE_EXTERNAL_MODULES``
(on ``import verl``), which registers both.  The agent loop calls :meth:`HFServer.generate` through
verl's ``LLMServerClient`` exactly as it calls vLLM's server: token ids in, :class:`TokenOutput` out.

Sampling (one request at a time, with the model's KV cache): token ``t`` is drawn from
``softmax(z / T)`` with ``z`` the fp32 logits, after verl's ``top_k`` (``-1``/``0``: off) and ``top_p``
filters; ``T = 0`` is greedy.  ``log_probs`` (when the request asks for them,
``rollout.calculate_log_probs=True``) are ``log_softmax(z / T)`` at the drawn tokens (``T = 0``:
``log_softmax(z)``), i.e. the sampling distribution before the filters.  Generation stops after the
model's EOS token(s) or ``max_tokens``, which defaults as in verl's vLLM server to
``min(response_length, prompt_length + response_length - len(prompt))``.  One replica per training
GPU: ``rollout.tensor_model_parallel_size``, ``data_parallel_size`` and
``pipeline_model_parallel_size`` must be 1.  Multimodal inputs and ``repetition_penalty != 1`` are
refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

#: The value of ``actor_rollout_ref.rollout.name`` that selects this rollout.
NAME = "hf"


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server (the worker's adapter looks it up by name)."""
    return f"hf_rollout_server_{replica_rank}"


def _single_gpu_replica(config: Any) -> None:
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if int(getattr(config, key)) != 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.{key} must be 1 for the HF rollout (got {getattr(config, key)})")


def _filtered(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``z`` ``[V]`` with the entries outside verl's ``top_k`` / ``top_p`` set to ``-inf``."""
    if 0 < top_k < z.numel():
        z = z.masked_fill(z < torch.topk(z, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(z, descending=True)
        cum = torch.softmax(z[order], dim=-1).cumsum(-1)
        drop = cum - torch.softmax(z[order], dim=-1) >= top_p  # keep the smallest prefix reaching top_p
        z = z.clone()
        z[order[drop]] = float("-inf")
    return z


class HFServer:
    """One replica's generation server (a Ray actor): an HF causal LM, fp32, on the colocated worker's GPU
    (the CPU where there is none).

    ``config``: verl's ``RolloutConfig``; ``model_path``: the HF directory the actor was loaded from (the
    weights are replaced by :meth:`load_weights` before the first generation); ``cuda_visible_devices``: the
    worker's GPU id (the actor is started with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, as verl's
    vLLM servers, so that it sets the device itself).
    """

    def __init__(self, config: Any, model_path: str, replica_rank: int, cuda_visible_devices: str | None,
                 trust_remote_code: bool = False) -> None:
        if cuda_visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.config = config
        self.replica_rank = replica_rank
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, trust_remote_code=trust_remote_code).to(self.device).eval()
        eos = GenerationConfig.from_model_config(self.model.config).eos_token_id
        self.eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.generator = torch.Generator(self.device).manual_seed(int(config.get("seed", 0)) + replica_rank)
        self.global_steps: int | None = None
        self.weight_updates = 0

    def load_weights(self, named: dict[str, torch.Tensor], global_steps: int | None) -> int:
        """Replace the model's weights by ``named`` (HF parameter name -> full tensor, any float dtype); returns
        the number of tensors loaded.  Raises ``ValueError`` for unknown names or parameters left out (tied
        weights excepted)."""
        result = self.model.load_state_dict(named, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        tied |= {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing = [k for k in result.missing_keys if k not in tied]
        if result.unexpected_keys or missing:
            raise ValueError(f"HF rollout weight sync: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        self.global_steps = global_steps
        self.weight_updates += 1
        return len(named)

    def status(self) -> dict[str, Any]:
        """The server's device, the global step of its weights and how many syncs it received."""
        return {"device": str(self.device), "global_steps": self.global_steps, "weight_updates": self.weight_updates,
                "replica_rank": self.replica_rank, "pid": os.getpid()}

    @torch.no_grad()
    def sample(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
               logprobs: bool) -> tuple[list[int], list[float] | None]:
        """Draw up to ``max_tokens`` tokens after ``prompt_ids`` (see the module docstring); returns the tokens and,
        with ``logprobs``, their log-probabilities under ``softmax(z / T)``."""
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        tokens, lps = [], []
        for _ in range(max_tokens):
            z = out.logits[0, -1].float()
            if temperature == 0:
                token = int(torch.argmax(z))
                lp = torch.log_softmax(z, dim=-1)[token]
            else:
                z = z / temperature
                probs = torch.softmax(_filtered(z, top_k, top_p), dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                lp = torch.log_softmax(z, dim=-1)[token]
            tokens.append(token)
            lps.append(float(lp))
            if token in self.eos:
                break
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=out.past_key_values,
                             use_cache=True)
        return tokens, (lps if logprobs else None)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, priority: int = 0, **kwargs: Any) -> TokenOutput:
        """verl's token-in-token-out call (``LLMServerClient.generate``); one request at a time."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("the HF rollout has no multimodal inputs")
        params = dict(sampling_params)
        if float(params.pop("repetition_penalty", 1.0)) != 1.0:
            raise ValueError("the HF rollout supports repetition_penalty=1.0 only")
        prompt_ids = [int(t) for t in prompt_ids]
        budget = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", None))
        max_tokens = min(self.config.response_length, budget) if max_tokens is None else int(max_tokens)
        tokens, lps = self.sample(prompt_ids, max(1, max_tokens), float(params.get("temperature", 1.0)),
                                  int(params.get("top_k", -1)), float(params.get("top_p", 1.0)),
                                  bool(params.get("logprobs", False)))
        return TokenOutput(token_ids=tokens, log_probs=lps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    # verl's replica control calls; the HF model keeps its weights and has no KV cache between requests.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """verl rollout replica of one :class:`HFServer`, colocated with its training worker (hybrid mode only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _single_gpu_replica(self.config)

    async def launch_servers(self) -> None:
        if self.rollout_mode != RolloutMode.HYBRID:
            raise ValueError(
                f"the HF rollout runs colocated with the actor only (hybrid engine), not {self.rollout_mode}")
        (worker,) = self.workers

        def where(_self: Any) -> tuple[str, list[str]]:
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]

        node_id, gpus = await worker.__ray_call__.remote(where)
        server = ray.remote(HFServer).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            name=server_name(self.replica_rank),
            num_cpus=0,
        ).remote(self.config, str(self.model_config.path), self.replica_rank, ",".join(gpus) or None,
                 bool(self.model_config.get("trust_remote_code", False)))
        await server.status.remote()  # started (raises here if the model cannot be loaded)
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)


class HFServerAdapter(BaseRollout):
    """The training worker's side of the HF rollout: verl's naive weight sync hands it the actor's full weights.

    Worker rank ``r`` feeds replica ``r`` (one GPU per replica).  :meth:`update_weights` copies every tensor to
    the CPU and loads it into the replica's server, tagged with ``global_steps``.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        _single_gpu_replica(self.config)
        self.replica_rank = int(os.environ["RANK"])
        self._server = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"the HF rollout takes wire_format='named_tensors', not {wire_format!r}")
        if hasattr(weights, "__aiter__"):
            named = {name: tensor.detach().to("cpu", copy=True) async for name, tensor in weights}
        else:
            named = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        await self._server.load_weights.remote(named, kwargs.get("global_steps"))


RolloutReplicaRegistry.register(NAME, lambda: HFReplica)
rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.{HFServerAdapter.__qualname__}"
