"""TEST STAND-IN for vLLM, used only by ``tests/gpu/launch_openrlhf.py`` (never by the library): OpenRLHF's rollout
engine generating with Hugging Face ``transformers`` instead of vLLM, for machines where vLLM cannot be installed.

OpenRLHF 0.11 generates only through its ``RolloutRayActor`` (``openrlhf/trainer/ray/vllm_engine.py``), which builds
``vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**kwargs))`` and drives it; its sample generator imports
``vllm.SamplingParams``.  This package provides exactly those names, so that everything of OpenRLHF around the engine
runs unchanged: ``create_vllm_engines`` and the placement of the rollout actors, ``RolloutRayActor`` with its agent
executor (``SingleTurnAgentExecutor``: prompt tokenisation, truncation, the reward function), the sleep / wake-up
choreography of the colocated hybrid engine, and the weight sync after every update through OpenRLHF's
``WorkerWrap`` (the ``worker_extension_cls`` OpenRLHF names): CUDA IPC handles when colocated, else OpenRLHF's
broadcast group, for which ``vllm.distributed`` provides ``StatelessProcessGroup`` and ``PyNcclCommunicator`` (over
gloo, staged through host memory: NCCL cannot join two processes on one GPU).  What differs from vLLM: generation is a plain token-by-token loop over the HF model with its KV cache,
one request at a time (no batching, no paged attention).

Sampling per request (``SamplingParams``): logits ``z`` (fp32) of the last position are divided by ``temperature``,
restricted to the ``top_k`` largest (``-1``: all) and to the smallest set whose probability reaches ``top_p``;
before ``min_tokens`` tokens the EOS token is excluded; a token is drawn from ``softmax`` of what is left with the
engine's ``torch.Generator`` (seeded with the engine's ``seed``), greedy when ``temperature == 0``.  Generation stops
at EOS (included in ``token_ids``, ``finish_reason "stop"``) or after ``max_tokens`` (``"length"``).  With
``logprobs`` set, each position also carries the sampled token's log-probability under the processed distribution
(vLLM's ``processed_logprobs``).

The engine keeps vLLM's sleep state: ``sleep()`` drops both the weights and the KV cache tags, ``wake_up(tags)``
restores the named ones; generating while either is asleep, or loading weights while the weights are asleep, raises
(so a run that passes has OpenRLHF's real choreography).  The model is moved to the CPU while its weights sleep.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
import types
from typing import Any, AsyncIterator

__version__ = "0.29.0"  # the release OpenRLHF 0.11.2 pins; PolicyModelActor reads it (>= 0.16: NCCL_CUMEM untouched)
STAND_IN = True  # tests/gpu/launch_openrlhf.py asserts that this, not a real vLLM, generated
_TAGS = ("weights", "kv_cache")


@dataclasses.dataclass
class SamplingParams:
    """The fields OpenRLHF's sample generator and agent executors set and read."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: temperature {self.temperature} must be >= 0, top_p {self.top_p} in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens {self.max_tokens} must be >= 1")


@dataclasses.dataclass
class Logprob:
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, Logprob]] | None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class AsyncEngineArgs:
    """The keyword arguments of ``create_vllm_engines`` (model, seed, dtype, worker_extension_cls, ...), kept as given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("AsyncEngineArgs stand-in: pass keyword arguments (as OpenRLHF does)")
        if "model" not in kwargs:
            raise TypeError("AsyncEngineArgs stand-in: model is required")
        self.kwargs = kwargs


def _dtype(name: Any) -> Any:
    import torch

    if isinstance(name, torch.dtype):
        return name
    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
             "float": torch.float32, "auto": torch.bfloat16}
    if name not in table:
        raise ValueError(f"AsyncEngineArgs stand-in: dtype {name!r} is not one of {sorted(table)}")
    return table[name]


class _Weights:
    """``model_runner.model`` of the worker: ``load_weights`` copies named tensors into the HF model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.loaded: list[str] = []

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"load_weights: the rollout model has no parameter {name!r}")
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self.loaded.append(name)


class _Worker:
    """What OpenRLHF's ``WorkerWrap`` methods read from a vLLM worker: ``device``, ``model_config.dtype``,
    ``model_runner.model.load_weights``."""

    def __init__(self, model: Any, device: Any, dtype: Any) -> None:
        self.device = device
        self.model_config = types.SimpleNamespace(dtype=dtype)
        self.model_runner = types.SimpleNamespace(model=_Weights(model))


def _worker_class(path: str | None) -> type:
    if not path:
        return _Worker
    module, _, name = path.rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    return type(f"StandInWorker_{name}", (_Worker, extension), {})


def _init_local_group() -> None:
    """A one-process torch.distributed group, as each vLLM worker has (``WorkerWrap`` asks for its rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class _OutputProcessor:
    def __init__(self) -> None:
        self.unfinished = 0

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


class AsyncLLMEngine:
    """One HF causal LM on this process's device (CUDA when visible, else CPU) behind vLLM's async engine API."""

    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw = engine_args.kwargs
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = _dtype(kw.get("dtype", "bfloat16"))
        self.max_model_len = kw.get("max_model_len")
        self.tokenizer = AutoTokenizer.from_pretrained(kw["model"], trust_remote_code=kw.get("trust_remote_code", False))
        self.model = AutoModelForCausalLM.from_pretrained(kw["model"], dtype=self.dtype,
                                                          trust_remote_code=kw.get("trust_remote_code", False))
        self.model.to(self.device).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.eos = set(self.eos if isinstance(self.eos, list) else [] if self.eos is None else [self.eos])
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.generator = torch.Generator(device=self.device).manual_seed(int(kw.get("seed", 0)))
        self.awake = set(_TAGS)
        _init_local_group()
        self.worker = _worker_class(kw.get("worker_extension_cls"))(self.model, self.device, self.dtype)
        self.output_processor = _OutputProcessor()
        self.calls: list[str] = []  # the engine methods OpenRLHF called, in order (consecutive repeats once)
        self._note("start", device=str(self.device), dtype=str(self.dtype), model=kw["model"])

    def _note(self, event: str, **more: Any) -> None:
        """Append ``event`` to :attr:`calls` (once per run of repeats) and, when ``ED_LAUNCH_PROBE_DIR`` is set (the
        GPU launch), one JSON line to ``engine-<pid>.jsonl`` there."""
        if not self.calls or self.calls[-1] != event:
            self.calls.append(event)
        folder = os.environ.get("ED_LAUNCH_PROBE_DIR")
        if folder:
            with open(os.path.join(folder, f"engine-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"event": event, **more}) + "\n")

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> "AsyncLLMEngine":
        return cls(engine_args)

    # ---- sleep mode (vLLM's tags: "weights", "kv_cache")
    async def is_sleeping(self) -> bool:
        return len(self.awake) < len(_TAGS)

    async def sleep(self, level: int = 1) -> None:
        self._note("sleep", level=level)
        self.awake.clear()
        self.model.to("cpu")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(_TAGS)
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}")
        self._note("wake_up", tags=tags)
        if "weights" in tags:
            self.model.to(self.device)
        self.awake.update(tags)

    async def reset_prefix_cache(self) -> None:
        self._note("reset_prefix_cache")

    async def pause_generation(self, mode: str = "keep") -> None:
        self._note("pause_generation")

    async def resume_generation(self) -> None:
        self._note("resume_generation")

    # ---- weight sync: OpenRLHF's WorkerWrap methods on the worker, as vLLM's collective_rpc runs them
    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if method.startswith("update_weight") and "weights" not in self.awake:
            raise RuntimeError(f"collective_rpc({method!r}) while the engine's weights are asleep")
        result = getattr(self.worker, method)(*args, **(kwargs or {}))
        self._note(method, name=args[0] if method.startswith("update_weight") and args else None)
        return [result]

    # ---- generation
    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        if len(self.awake) < len(_TAGS):
            raise RuntimeError(f"generate while the engine sleeps (awake: {sorted(self.awake)})")
        self.output_processor.unfinished += 1
        try:
            ids = list(prompt["prompt_token_ids"])
            out = self.sample(ids, sampling_params)
        finally:
            self.output_processor.unfinished -= 1
        self._note("generate", prompt_tokens=len(ids), tokens=len(out.token_ids), finish=out.finish_reason)
        yield RequestOutput(request_id=request_id, prompt_token_ids=ids, outputs=[out])

    def sample(self, prompt_token_ids: list[int], params: SamplingParams) -> CompletionOutput:
        """One completion of ``prompt_token_ids`` (see the module doc for the sampling rule)."""
        import torch

        params = copy.deepcopy(params)
        limit = params.max_tokens
        if limit is None:
            if self.max_model_len is None:
                raise ValueError("SamplingParams.max_tokens is None and the engine has no max_model_len")
            limit = max(1, self.max_model_len - len(prompt_token_ids))
        tokens: list[int] = []
        logprobs: list[dict[int, Logprob]] = []
        finish = "length"
        past = None
        step_input = torch.tensor([prompt_token_ids], device=self.device)
        with torch.no_grad():
            for t in range(limit):
                out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                if t < params.min_tokens and self.eos:
                    logits[list(self.eos)] = -float("inf")
                token, logprob = self._draw(logits, params)
                tokens.append(token)
                logprobs.append({token: Logprob(logprob)})
                if token in self.eos:
                    finish = "stop"
                    break
                step_input = torch.tensor([[token]], device=self.device)
        text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
        return CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=finish,
                                logprobs=logprobs if params.logprobs is not None else None)

    def _draw(self, logits: Any, params: SamplingParams) -> tuple[int, float]:
        import torch

        if params.temperature == 0:
            logp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(logits))
            return token, float(logp[token])
        z = logits / params.temperature
        if 0 < params.top_k < z.numel():
            kth = torch.topk(z, params.top_k).values[-1]
            z = z.masked_fill(z < kth, -float("inf"))
        if params.top_p < 1.0:
            order = torch.argsort(z, descending=True)
            probs = torch.softmax(z[order], -1)
            before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each
            z[order[before >= params.top_p]] = -float("inf")
        logp = torch.log_softmax(z, -1)
        token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
        return token, float(logp[token])
