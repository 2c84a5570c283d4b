"""The OpenRLHF adapter (0.10.2 - 0.11.x) against the real OpenRLHF modules, on a CPU.

Modules that cannot be installed on a CPU machine are replaced by stand-ins before OpenRLHF is
imported, and only when absent:

* ``flash_attn`` (its wheel needs CUDA): OpenRLHF's packing code imports four helpers from
  ``flash_attn.bert_padding`` and ``all_gather`` from ``flash_attn.utils.distributed``. The
  stand-ins are working functions: transformers' own pure-torch ``_unpad_input`` / ``_pad_input``
  (the same contract as flash_attn's), ``tensor[indices]`` for ``index_first_axis``,
  ``einops.rearrange``, and an all-gather along dim 0 through ``torch.distributed``;
* ``ring_flash_attn`` (needs flash_attn): ``update_ring_flash_attn_params`` does nothing. Each
  ring rank's eager attention then sees only its own slice, so the ring tests compare the adapter
  with OpenRLHF's own outputs under that same attention, not with a real ring;
* ``vllm`` (GPU-only; imported by ``openrlhf/trainer/ray/__init__.py``): empty.

Packed samples run through transformers' eager attention, which keeps packed sequences apart from
their ``position_ids`` (``masking_utils.find_packed_sequence_indices``), as flash-attention does.
Everything else is real: OpenRLHF, transformers, deepspeed, ray (``nox -s openrlhf``).
Set ``ED_REQUIRE_OPENRLHF=1`` (the nox session does) to fail instead of skip without OpenRLHF.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

STUBBED_MODULES = (
    "flash_attn",
    "flash_attn.bert_padding",
    "flash_attn.utils",
    "flash_attn.utils.distributed",
    "ring_flash_attn",
    "vllm",
    "vllm.inputs",
    "vllm.utils",
)


def _all_gather_dim0(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """flash_attn.utils.distributed.all_gather: concatenate every rank's tensor along dim 0."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def _index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """flash_attn.bert_padding.index_first_axis: ``tensor[indices]`` on an already flattened first axis."""
    return tensor[indices]


def _stand_in(name: str):
    """A working stand-in where OpenRLHF calls into the module, an empty one elsewhere."""
    if name == "flash_attn.bert_padding":
        import einops
        from transformers import modeling_flash_attention_utils as fa

        module = types.ModuleType(name)
        module.unpad_input, module.pad_input = fa._unpad_input, fa._pad_input
        module.index_first_axis = _index_first_axis
        module.rearrange = einops.rearrange
    elif name == "flash_attn.utils.distributed":
        module = types.ModuleType(name)
        module.all_gather = _all_gather_dim0
    elif name == "ring_flash_attn":
        module = types.ModuleType(name)
        module.update_ring_flash_attn_params = lambda cu_seqlens, group: None
    else:
        module = MagicMock(name=name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def install_stubs() -> list[str]:
    """Stand-ins for the CPU-uninstallable modules that are missing; returns their names."""
    # transformers records at import time whether flash_attn is installed (5.5 fails on a stand-in
    # it cannot map to a distribution): let it see the real environment first.
    import transformers.modeling_utils  # noqa: F401

    added = []
    for name in STUBBED_MODULES:
        root = name.split(".")[0]
        if name in sys.modules or (root not in added and importlib.util.find_spec(root) is not None):
            continue
        sys.modules[name] = _stand_in(name)
        added.append(name)
    return added


install_stubs()
if importlib.util.find_spec("openrlhf") is None:
    if os.environ.get("ED_REQUIRE_OPENRLHF") == "1":
        raise ImportError("openrlhf is not installed but ED_REQUIRE_OPENRLHF=1 (run `nox -s openrlhf`)")
    pytest.skip("openrlhf not installed (run `nox -s openrlhf`)", allow_module_level=True)

from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch  # noqa: E402
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402

from entropy_discriminator import EntropyDiscConfig, apply_keep_mask  # noqa: E402
from entropy_discriminator.adapters import openrlhf as adapter  # noqa: E402
from entropy_discriminator.adapters.openrlhf._round import (  # noqa: E402
    apply_keep,
    begin_round,
    replay_buffer_stats,
)

TEMPERATURE = 0.7
VOCAB = 97
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "openrlhf"


@pytest.fixture(autouse=True)
def _clean_patch():
    adapter.unpatch()
    yield
    adapter.unpatch()


# ----------------------------------------------------------------------------------------- helpers


def tiny_actor(seed: int = 0, packing: bool = False) -> Actor:
    """OpenRLHF's ``Actor`` around a randomly initialised 2-layer Llama (no hub access)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager", use_cache=False,
    )
    model = LlamaForCausalLM(cfg).float()
    actor = Actor(model, temperature=TEMPERATURE)
    actor.packing_samples = packing  # set by Actor.__init__ only when it loads a checkpoint by name
    return actor


def rollout_batch(seed: int, n: int = 6, prompt_len: int = 5, max_resp: int = 8, layout: str = "v0.11") -> Experience:
    """A generation batch, right-padded, with per-token GAE-like advantages; in one sample one
    interior response token is masked out (as tool output is in multi-turn rollouts).

    ``layout="v0.11"`` is what OpenRLHF 0.11.2's samples generator builds: unpadded prompt +
    response, ``action_mask`` over positions ``1..T-1`` (``action_mask[t]``: token ``t + 1`` is an
    action). ``"left_padded"``: prompts left-padded to ``prompt_len``, ``action_mask`` over the
    response columns only (OpenRLHF's older layout; ``Actor.forward`` serves both)."""
    g = torch.Generator().manual_seed(seed)
    seqs, amask = [], []
    for i in range(n):
        p_len = int(torch.randint(2, prompt_len + 1, (1,), generator=g))
        r_len = int(torch.randint(2, max_resp + 1, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (p_len,), generator=g)
        resp = torch.randint(1, VOCAB, (r_len,), generator=g)
        if layout == "v0.11":
            seqs.append(torch.cat([prompt, resp]))
            m = torch.cat([torch.zeros(p_len - 1), torch.ones(r_len)]).bool()
        else:
            seqs.append(torch.cat([torch.zeros(prompt_len - p_len, dtype=torch.long), prompt, resp]))
            m = torch.ones(r_len, dtype=torch.bool)
        if i == 1:
            m[-2] = False
        amask.append(m)
    width = max(len(x) for x in seqs)
    sequences = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    action_mask = torch.zeros(n, max(len(m) for m in amask), dtype=torch.bool)
    for i, (x, m) in enumerate(zip(seqs, amask)):
        sequences[i, : len(x)] = x
        attention_mask[i, : len(x)] = (x != 0).long() if layout != "v0.11" else 1
        action_mask[i, : len(m)] = m
    advantages = torch.randn(action_mask.shape, generator=g) * action_mask
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=torch.zeros(action_mask.shape),
        advantages=advantages,
        returns=advantages.clone(),
        response_length=action_mask.sum(-1).float(),
        total_length=attention_mask.sum(-1).float(),
        info={},
    )


def filled_buffer(experience: Experience, micro_batch_size: int, monkeypatch) -> NaiveReplayBuffer:
    """OpenRLHF's own replay buffer after ``append`` (split into samples, right padding removed)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # NaiveReplayBuffer.__init__ asks for it
    buffer = NaiveReplayBuffer(micro_batch_size, cpu_offload=True)
    buffer.append(experience)
    return buffer


def reference_stats(actor: Actor, item: Experience) -> dict[str, torch.Tensor]:
    """float64 reference for one buffered sample: a float64 forward of its tokens without the left
    padding (positions 0..n-1, which is what OpenRLHF's position_ids give them), temperature,
    log-softmax; row t scores token t + 1."""
    model = actor.model
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.double()
    try:
        tokens = item.sequences[item.attention_mask.bool()]
        with torch.no_grad():
            z = model(tokens[None]).logits[0].double()
    finally:
        model.float()
        model.load_state_dict(original)
    n_act, n_seq = item.action_mask.numel(), tokens.numel()
    logq = torch.log_softmax(z[n_seq - n_act - 1 : n_seq - 1] / TEMPERATURE, dim=-1)
    labels = tokens[n_seq - n_act :]
    p = logq.exp()
    entropy = -(p * logq).sum(-1)
    logp = logq.gather(-1, labels[:, None])[:, 0]
    s_star = logp.exp() * (entropy + logp)
    s_expected = (p * p * (entropy[:, None] + logq)).sum(-1)
    s_centered = s_star - s_expected
    return {"logp": logp, "entropy": entropy, "s_star": s_star, "s_expected": s_expected, "s_centered": s_centered}


class FakeStrategy:
    """The parts of OpenRLHF's DeepspeedStrategy that ``ActorPPOTrainer.ppo_train`` uses, single process."""

    def __init__(self, args, mesh=None):
        self.args, self.ring_attn_group, self.accumulated_gradient = args, None, 1
        if mesh is not None:
            self.ds_device_mesh = mesh

    def backward(self, loss, model, optimizer):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name=None):
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def all_reduce(self, data, op="mean"):
        return data

    def is_rank_0(self):
        return True

    def get_grad_norm(self, model):
        return 0.0


def training_args(*, epochs: int = 2, packing: bool = False, **overrides) -> SimpleNamespace:
    """OpenRLHF's hierarchical arguments, as far as ``ppo_train``/``training_step`` and the adapter's
    checks read them; ``overrides`` maps dotted names (``"actor.entropy_coef"``) to values."""
    args = SimpleNamespace(
        train=SimpleNamespace(max_epochs=epochs, dynamic_batch_enable=False),
        ds=SimpleNamespace(tensor_parallel_size=1, packing_samples=packing, ring_attn_size=1, zero_stage=2),
        actor=SimpleNamespace(entropy_coef=None, aux_loss_coef=0.0, policy_loss_type="ppo"),
        algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, init_coef=0.0, estimator="k3", unbiased_gradient=False)),
    )
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = args
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return args


def real_trainer(actor: Actor, buffer: NaiveReplayBuffer, *, epochs: int = 2, mesh=None, args=None,
                 loss_fn=None, micro_batch_size: int = 2):
    """An ``ActorPPOTrainer`` with the attributes its ``__init__`` sets, minus DeepSpeed/vLLM/CUDA."""
    args = training_args(epochs=epochs, packing=actor.packing_samples) if args is None else args
    trainer = ppo_actor.ActorPPOTrainer.__new__(ppo_actor.ActorPPOTrainer)
    optim = torch.optim.SGD(actor.parameters(), lr=0.5)
    trainer.__dict__.update(
        strategy=FakeStrategy(args, mesh), args=args, actor=actor, ema_model=None, actor_optim=optim,
        actor_scheduler=torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0),
        micro_train_batch_size=micro_batch_size, max_epochs=args.train.max_epochs, replay_buffer=buffer,
        actor_loss_fn=PolicyLoss() if loss_fn is None else loss_fn, aux_loss=False,
        dataloader_pin_memory=False,
    )
    return trainer


# ------------------------------------------------------------------------------------------- tests


def test_stubbed_modules_are_listed_and_openrlhf_is_real():
    import openrlhf

    assert adapter.check_openrlhf_version() == os.environ.get("ED_OPENRLHF_RELEASE", "0.11.2")
    assert openrlhf.__file__ and "site-packages" in openrlhf.__file__
    for name in ("deepspeed", "ray", "transformers"):
        assert not isinstance(sys.modules[name], MagicMock), name
    for name in sys.modules:
        if isinstance(sys.modules[name], MagicMock):
            assert name in STUBBED_MODULES


@pytest.mark.parametrize("version", ["0.10.1", "0.10.0", "0.10.2rc1", "0.10.2.dev0", "0.12.0", "0.12.0rc1", "1.0.0"])
def test_version_outside_range_is_refused_with_reason(version):
    with pytest.raises(adapter.UnsupportedVersionError, match=r"openrlhf .* is not supported.*because .*ppo_train"):
        adapter.check_openrlhf_version(version)


def test_patch_refuses_unsupported_installed_version(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.1" if name == "openrlhf" else "0")
    with pytest.raises(adapter.UnsupportedVersionError, match="0.12.1"):
        adapter.patch(EntropyDiscConfig(method="clip_b"))
    assert not adapter.is_patched()


def test_patch_is_idempotent_and_reversible():
    original = ppo_actor.ActorPPOTrainer.ppo_train
    adapter.patch(EntropyDiscConfig(method="clip_b"))
    wrapped = ppo_actor.ActorPPOTrainer.ppo_train
    assert adapter.is_patched() and wrapped is not original and wrapped.__wrapped__ is original
    adapter.patch(EntropyDiscConfig(method="clip_v"))
    assert ppo_actor.ActorPPOTrainer.ppo_train is wrapped  # not wrapped twice
    adapter.unpatch()
    assert ppo_actor.ActorPPOTrainer.ppo_train is original and "ppo_train" in vars(ppo_actor.ActorPPOTrainer)
    assert not adapter.is_patched()
    adapter.unpatch()  # a second unpatch does nothing
    assert ppo_actor.ActorPPOTrainer.ppo_train is original


def test_worker_setup_hook_patches_from_environment(monkeypatch):
    cfg = EntropyDiscConfig(method="clip_v", mu_low=3.0, mask_mode="drop_token")
    env = adapter.runtime_env(cfg, realised=True, base={"env_vars": {"NCCL_DEBUG": "WARN"}})
    assert env["worker_process_setup_hook"] == adapter.SETUP_HOOK
    assert adapter.SETUP_HOOK == "entropy_discriminator.adapters.openrlhf.worker_setup_hook"
    assert env["env_vars"]["NCCL_DEBUG"] == "WARN"
    monkeypatch.setenv(adapter.CONFIG_ENV, env["env_vars"][adapter.CONFIG_ENV])
    from ray._common.utils import load_class  # what Ray's worker does with the hook string

    load_class(env["worker_process_setup_hook"])()
    assert adapter.is_patched()
    from entropy_discriminator.adapters.openrlhf import _patch as _openrlhf_patch

    assert _openrlhf_patch._STATE.config == cfg and _openrlhf_patch._STATE.realised is True
    adapter.unpatch()
    assert not adapter.is_patched()


def test_worker_setup_hook_errors_name_the_variable(monkeypatch):
    monkeypatch.delenv(adapter.CONFIG_ENV, raising=False)
    with pytest.raises(RuntimeError, match=adapter.CONFIG_ENV):
        adapter.worker_setup_hook()
    monkeypatch.setenv(adapter.CONFIG_ENV, json.dumps({"config": {"method": "clip_z"}}))
    with pytest.raises(ValueError, match=adapter.CONFIG_ENV):
        adapter.worker_setup_hook()
    with pytest.raises(ValueError, match="worker_process_setup_hook"):
        adapter.runtime_env(EntropyDiscConfig(), base={"worker_process_setup_hook": "other.hook"})


def test_split_and_parse_flags():
    argv = ["--actor.model_name_or_path", "m", "--entropy_disc.method", "clip_v", "--rollout.temperature", "0.7",
            "--entropy_disc.mu_low=3", "--entropy_disc.realised", "--entropy_disc.max_frac", "none",
            "--entropy_disc.mu_high", "inf", "--train.seed", "-1"]
    cfg, realised, rest = adapter.parse(argv)
    assert rest == ["--actor.model_name_or_path", "m", "--rollout.temperature", "0.7", "--train.seed", "-1"]
    assert (cfg.method, cfg.mu_low, cfg.max_frac, cfg.mu_high, realised) == ("clip_v", 3.0, None, math.inf, True)
    assert adapter.parse([])[0] == EntropyDiscConfig()
    with pytest.raises(SystemExit):
        adapter.parse(["--entropy_disc.method", "clip_z"])
    with pytest.raises(SystemExit):
        adapter.parse(["--entropy_disc.mu_low", "-1"])  # EntropyDiscConfig.validate names mu_low
    with pytest.raises(SystemExit, match="expects a value"):
        adapter.parse(["--entropy_disc.sides"])
    with pytest.raises(SystemExit):
        adapter.parse(["--entropy_disc.unknown", "1"])


def test_cap_rule_flag_reaches_the_config(capsys):
    """--entropy_disc.cap_rule selects the reference's at-least-one-token cap; a bad value is refused by name."""
    cfg = adapter.parse(["--entropy_disc.method", "clip_v", "--entropy_disc.max_frac", "1e-4",
                         "--entropy_disc.cap_rule", "reference"])[0]
    assert (cfg.cap_rule, cfg.max_frac) == ("reference", 1e-4)
    assert adapter.parse([])[0].cap_rule == "share"
    with pytest.raises(SystemExit):
        adapter.parse(["--entropy_disc.cap_rule", "floor"])
    assert "--entropy_disc.cap_rule" in capsys.readouterr().err


class _StopAtRayInit(Exception):
    pass


def test_launcher_hands_the_rest_to_train_ppo_ray(monkeypatch, capsys):
    """Runs the real ``openrlhf.cli.train_ppo_ray`` as __main__ until its ``ray.init``."""
    import ray

    seen = {}

    def fake_init(*args, **kwargs):
        seen.update(kwargs)
        raise _StopAtRayInit

    monkeypatch.setattr(ray, "init", fake_init)
    argv = ["--actor.model_name_or_path", "tiny", "--reward.remote_url", "http://127.0.0.1:9/reward",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--entropy_disc.method", "clip_b", "--entropy_disc.mu_low", "2.0", "--rollout.batch_size", "8"]
    with pytest.raises(_StopAtRayInit):  # an unknown flag would have been SystemExit(2) from argparse
        adapter.main(argv)
    assert ray.init is fake_init  # the launcher's wrapper is gone again
    env = seen["runtime_env"]
    assert env["worker_process_setup_hook"] == adapter.SETUP_HOOK
    assert {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG"} <= set(env["env_vars"])  # OpenRLHF's own are kept
    payload = json.loads(env["env_vars"][adapter.CONFIG_ENV])
    assert payload["config"]["method"] == "clip_b" and payload["config"]["mu_low"] == 2.0
    with pytest.raises(SystemExit) as exc:
        adapter.main(["--actor.model_name_or_path", "tiny", "--no_such_openrlhf_flag", "1"])
    assert exc.value.code == 2 and "no_such_openrlhf_flag" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["ppo_gae.sh", "grpo.sh"])
@pytest.mark.parametrize("method", ["clip_b", "clip_v"])
def test_example_scripts_are_accepted_by_openrlhf(script, method, monkeypatch):
    """Every flag of the example launch scripts is known to the launcher or to OpenRLHF 0.11.2's CLI,
    whose own argument checks pass up to ``ray.init``."""
    import ray

    out = subprocess.run(["bash", str(EXAMPLES / script), method], env={**os.environ, "ED_PRINT_ARGS": "1"},
                         capture_output=True, check=True).stdout
    argv = out.decode().split("\0")[:-1]
    cfg, _, rest = adapter.parse(argv)
    assert cfg.method == method and not any(a.startswith("--entropy_disc") for a in rest)
    estimator = rest[rest.index("--algo.advantage.estimator") + 1]
    assert estimator == {"ppo_gae.sh": "gae", "grpo.sh": "group_norm"}[script]
    seen = {}

    def fake_init(*args, **kwargs):
        seen.update(kwargs)
        raise _StopAtRayInit

    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(_StopAtRayInit):
        adapter.main(argv)
    assert json.loads(seen["runtime_env"]["env_vars"][adapter.CONFIG_ENV])["config"]["method"] == method


def _example_flags(script: str, method: str, **env: str) -> dict[str, str | None]:
    """The example's OpenRLHF flags as ``{flag: value}`` (``None`` for a switch), as its launch passes them."""
    out = subprocess.run(["bash", str(EXAMPLES / script), method], env={**os.environ, "ED_PRINT_ARGS": "1", **env},
                         capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    flags: dict[str, str | None] = {}
    for i, token in enumerate(out):
        if token.startswith("--"):
            value = out[i + 1] if i + 1 < len(out) and not out[i + 1].startswith("--") else None
            flags[token] = value
    return flags


@pytest.mark.parametrize("script", ["ppo_gae.sh", "grpo.sh"])
@pytest.mark.parametrize("n_gpus", [None, "8"])
def test_example_scripts_run_on_one_gpu_by_default(script, n_gpus):
    """Every model group asks for N_GPUS GPUs (default 1), colocated with the vLLM engines that fill them, so the
    launch never waits for GPUs the machine lacks (OpenRLHF's own default is 8 per group)."""
    flags = _example_flags(script, "clip_v", **({} if n_gpus is None else {"N_GPUS": n_gpus}))
    want = n_gpus or "1"
    groups = [f for f in flags if f.endswith(".num_gpus_per_node")]
    assert {"--actor.num_gpus_per_node", "--ref.num_gpus_per_node"} <= set(groups)
    assert all(flags[f] == want for f in groups) and "--train.colocate_all" in flags
    assert int(flags["--vllm.num_engines"]) * int(flags["--vllm.tensor_parallel_size"]) == int(want)
    if n_gpus is None:
        assert flags["--actor.model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"


def _ratio_loss_reference(log_probs, old, adv, mask, keep, mode, token_level):
    """Core path: per-token PPO loss, ``apply_keep_mask``, then OpenRLHF's aggregation rule."""
    ratio = (log_probs - old).clamp(-20, 20).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    pg, lm = apply_keep_mask(per_token, keep, mask, mode=mode)
    lm = lm.to(pg.dtype)
    if token_level:
        return (pg * lm).sum() / lm.sum()
    counts = lm.sum(-1)
    seq = (pg * lm).sum(-1) / (counts + 1e-8)
    return (seq * (counts > 0)).sum() / (counts > 0).sum()


@pytest.mark.parametrize("mode", ["zero_pg", "drop_token"])
@pytest.mark.parametrize("estimator", ["gae", "group_norm"])
# sequence-mean aggregation: from 0.10.3 (before, only GSPO uses it, which the adapter refuses there)
@pytest.mark.parametrize("token_level", [True, False] if importlib.util.find_spec("openrlhf.utils.loss_utils") else [True])
def test_loss_path_with_mask_equals_core(mode, estimator, token_level):
    """OpenRLHF's PolicyLoss + its global normaliser on the masked buffer == core apply_keep_mask."""
    g = torch.Generator().manual_seed(3)
    exp = rollout_batch(7)
    n, a = exp.action_mask.shape
    if estimator == "group_norm":  # one advantage per sequence, broadcast over its tokens
        exp.advantages = torch.randn(n, 1, generator=g).expand(n, a) * exp.action_mask
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    items = split_experience_batch(exp)
    adv0, mask0 = exp.advantages.clone(), exp.action_mask.clone()
    keep = torch.rand(int(mask0.numel()), generator=g) > 0.3
    apply_keep(items, keep, mode)
    batch = make_experience_batch(items)
    info = {}  # before 0.10.3 PolicyLoss normalises per micro-batch itself
    if importlib.util.find_spec("openrlhf.utils.loss_utils") is not None:  # OpenRLHF's global normaliser
        from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

        (_, info), = iter_grad_accum_global_norm([batch], None, 1, lambda e: e.action_mask)
    log_probs = (torch.randn(n, a, generator=g) * 0.3 - 1).requires_grad_()
    old = torch.randn(n, a, generator=g) * 0.3 - 1
    loss_fn = PolicyLoss(token_level_loss=token_level)
    loss = loss_fn(log_probs, old, batch.advantages, action_mask=batch.action_mask, **info)[0]
    lp_ref = log_probs.detach().clone().requires_grad_()
    ref = _ratio_loss_reference(lp_ref, old, adv0, mask0, keep.reshape(n, a), mode, token_level)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(log_probs.grad, lp_ref.grad, rtol=1e-6, atol=1e-8)
    clipped = mask0 & ~keep.reshape(n, a)
    assert clipped.any() and (log_probs.grad[clipped] == 0).all()
    # the unmasked loss differs, so the comparison above can fail
    plain = _ratio_loss_reference(lp_ref.detach(), old, adv0, mask0, torch.ones_like(mask0), mode, token_level)
    assert not torch.allclose(plain, ref.detach())


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("layout", ["v0.11", "left_padded"])
def test_replay_buffer_pass_equals_float64_reference(layout, packing, monkeypatch):
    actor = tiny_actor(packing=packing)
    buffer = filled_buffer(rollout_batch(11, layout=layout), micro_batch_size=4, monkeypatch=monkeypatch)
    items = buffer.items
    valids = [it.action_mask.bool() for it in items]
    assert len({it.action_mask.numel() for it in items}) > 1  # ragged samples after unpadding
    stats = replay_buffer_stats(actor, items, valids, micro_batch_size=4, impl="torch")
    assert actor.temperature == TEMPERATURE and actor.training
    offset = 0
    for item, valid in zip(items, valids):
        ref = reference_stats(actor, item)
        n = valid.numel()
        assert torch.equal(stats.valid[offset : offset + n], valid)
        for name, value in ref.items():
            got = getattr(stats, name)[offset : offset + n]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got[valid].double(), value[valid], rtol=1e-4, atol=2e-6, msg=name)
            assert (got[~valid] == 0).all()
        offset += n
    assert offset == stats.valid.numel()
    # same one-token alignment as the trainer: the pass's logp is OpenRLHF's action_log_probs
    batch = make_experience_batch(items[:4])
    with torch.no_grad():
        lp = actor(batch.sequences, batch.action_mask, batch.attention_mask)
    sizes = [v.numel() for v in valids[:4]]
    for row, (got, valid) in enumerate(zip(stats.logp[: sum(sizes)].split(sizes), valids)):
        torch.testing.assert_close(got[valid], lp[row, : valid.numel()][valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,mode", [("clip_b", "zero_pg"), ("clip_v", "drop_token")])
def test_patched_ppo_train_end_to_end(method, mode, monkeypatch):
    """The real ActorPPOTrainer.ppo_train, patched, on a tiny model: mask, update, metrics."""
    actor = tiny_actor()
    buffer = filled_buffer(rollout_batch(5, n=8), micro_batch_size=2, monkeypatch=monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # ppo_train moves batches there
    trainer = real_trainer(actor, buffer)
    adv_before = [it.advantages.clone() for it in buffer.items]
    mask_before = [it.action_mask.clone() for it in buffer.items]
    params_before = [p.detach().clone() for p in actor.parameters()]
    cfg = EntropyDiscConfig(method=method, mu_low=0.5, max_frac=None, sides="both", mask_mode=mode)
    adapter.patch(cfg, realised=True)
    status = trainer.ppo_train(0.0)
    assert "policy_loss" in status  # OpenRLHF's own status is kept
    n_clipped = status["entropy_disc/clip/n_clipped"]
    assert n_clipped > 0 and 0 < status["entropy_disc/clip/frac"] < 1
    for key in ("entropy/mean", "s_star/std", "s_centered/std", "cov/adv_s_centered", "delta_entropy/predicted",
                "delta_entropy/realised", "clip/threshold_low", "timing/stats_pass"):
        assert math.isfinite(status["entropy_disc/" + key]), key
    n_changed = 0
    for item, adv, mask in zip(buffer.items, adv_before, mask_before):
        if mode == "zero_pg":
            assert torch.equal(item.action_mask, mask)
            changed = (item.advantages != adv) & mask.bool()
            assert (item.advantages[changed] == 0).all()
        else:
            assert torch.equal(item.advantages, adv)
            changed = mask.bool() & ~item.action_mask.bool()
        n_changed += int(changed.sum())
    assert n_changed == n_clipped
    assert any(not torch.equal(p, q) for p, q in zip(params_before, actor.parameters()))
    adapter.unpatch()
    assert "entropy_disc/clip/frac" not in trainer.ppo_train(0.0)


def test_metrics_only_leaves_buffer_unchanged(monkeypatch):
    actor = tiny_actor()
    buffer = filled_buffer(rollout_batch(5), micro_batch_size=2, monkeypatch=monkeypatch)
    trainer = real_trainer(actor, buffer)
    adv_before = [it.advantages.clone() for it in buffer.items]
    state = begin_round(trainer, EntropyDiscConfig())
    assert state.mask is None and "entropy_disc/entropy/p50" in state.metrics
    assert "entropy_disc/clip/frac" not in state.metrics
    assert all(torch.equal(it.advantages, a) for it, a in zip(buffer.items, adv_before))
    n_valid = sum(int(it.action_mask.sum()) for it in buffer.items)
    assert state.metrics["entropy_disc/tokens/valid"] == n_valid


def test_autopilot_is_served(monkeypatch):
    """``method="autopilot"`` is accepted by patch, patch_on_import, runtime_env and the launcher (the controller
    and its checkpointed state: test_openrlhf_autopilot.py)."""
    from entropy_discriminator import EntropyDiscConfig

    cfg = EntropyDiscConfig(method="autopilot")
    adapter.patch(cfg)
    assert adapter.is_patched()
    adapter.unpatch()
    adapter.patch_on_import(cfg)
    assert adapter.is_patched()
    assert json.loads(adapter.runtime_env(cfg)["env_vars"][adapter.CONFIG_ENV])["config"]["method"] == "autopilot"
    assert adapter.parse(["--entropy_disc.method", "autopilot"])[0] == cfg
