"""GRPO with Clip_B / Clip_V (entropy discriminator) in TRL 1.14-1.16: Qwen2.5-0.5B-Instruct on GSM8K.

Install, from the repository root of a clone (the package is not on the package index)::

    pip install -e ".[trl]"

Run, one GPU with hub access (the ``--entropy_disc_*`` flags are fields of ``EntropyDiscGRPOConfig``; every
``GRPOConfig`` flag works too)::

    python examples/trl/grpo_entropy_disc.py --output_dir out/grpo_none                          # monitor only
    python examples/trl/grpo_entropy_disc.py --output_dir out/grpo_clip_b --entropy_disc_method clip_b
    python examples/trl/grpo_entropy_disc.py --output_dir out/grpo_clip_v --entropy_disc_method clip_v

Several GPUs: ``accelerate launch --num_processes 4 examples/trl/grpo_entropy_disc.py ...`` (the
mask's statistics are then global over all processes).  ``--use_patch`` trains a stock
``GRPOTrainer`` made to behave the same by ``patch()``; ``--entropy_disc_mask_source current``
recomputes the mask per micro-batch from the current policy.

Both masks default to mu = 2.5 with no cap (README "Defaults"); the reference's 7B-model setting is
``--entropy_disc_mu_low 8.5 --entropy_disc_max_frac 1e-4 --entropy_disc_cap_rule reference``.

Choosing mu for your model (docs/choosing-mu.md): ``--max_steps 1 --save_batch batch.pt`` saves the first batch
the adapter masks; ``entropy-discriminator suggest-mu --batch batch.pt`` gives the mu that clips a target share.

``--tiny`` runs the same code path without the hub: a randomly initialised Llama
(``--tiny_hidden``/``--tiny_layers``), an in-memory tokenizer and "what is x plus y" prompts
(``examples/trl/tiny.py``), on any machine, CPU included (bf16 is used only where the device has it).
``--tiny`` also changes the defaults to 12 steps of 16-token completions at lr 1e-2 (entropy moves within
them) and, for Clip_B / Clip_V, mu 1.0 (``TINY_MU``: the library's 2.5 clips nothing there).  About two minutes
on a 2-core CPU; ``examples/trl/compare_tiny.py`` runs it once per method and compares::

    python examples/trl/grpo_entropy_disc.py --tiny --output_dir out/tiny --entropy_disc_method clip_v

The metrics (``entropy_disc/entropy/mean``, ``entropy_disc/clip/frac``, ``reward``, ...) go to
TRL's logs (``--report_to`` wandb/tensorboard/none) and, with checkpoints (``--save_steps N``), to each
checkpoint's ``trainer_state.json`` (``entropy-discriminator plot`` draws them); ``--summary_json`` also writes
the log history and a short summary of the first and last logged steps.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOTrainer, TrlParser

from entropy_discriminator import EntropyDiscConfig, save_batch
from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, EntropyDiscGRPOTrainer, patch

#: ``--tiny`` defaults.  TINY_MU: what ``entropy-discriminator suggest-mu --batch`` gives on the tiny run's first
#: batch (``--save_batch``) for about 5 % with Clip_V (1 % to 2 % with Clip_B); the library's 2.5 clips nothing there.
TINY_STEPS, TINY_LR, TINY_MU = 12, 1e-2, 1.0
SYSTEM_PROMPT = (
    "Solve the math problem step by step. Put the final answer, a number only, on the last line after '####'."
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class ExampleArguments:
    model_name_or_path: str = field(default="Qwen/Qwen2.5-0.5B-Instruct", metadata={"help": "Policy model."})
    dataset_name: str = field(default="openai/gsm8k", metadata={"help": "Dataset on the hub."})
    dataset_config: str = field(default="main", metadata={"help": "Dataset config."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training problems."})
    use_patch: bool = field(default=False, metadata={"help": "Train a stock GRPOTrainer through patch()."})
    tiny: bool = field(default=False, metadata={"help": "Local random tiny model, tokenizer and prompts (no hub)."})
    tiny_hidden: int = field(default=64, metadata={"help": "--tiny: hidden size."})
    tiny_layers: int = field(default=2, metadata={"help": "--tiny: layers."})
    summary_json: str | None = field(default=None, metadata={"help": "Write log history and a summary here."})
    save_batch: str | None = field(default=None, metadata={
        "help": "Save the first masked batch's mask inputs here, for entropy-discriminator suggest-mu --batch "
                "(clip_b / clip_v; this process's share of the batch)."})


def _number(text: str) -> float | None:
    """The number after the last '####', else the last number in ``text``; None if there is none."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = _NUMBER.findall(tail) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def accuracy_reward(completions: list, answer: list[str], **_: object) -> list[float]:
    """1.0 when the completion's final number equals the GSM8K answer (after '####'), else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        pred, ref = _number(text), _number(gold)
        rewards.append(1.0 if pred is not None and ref is not None and abs(pred - ref) < 1e-6 else 0.0)
    return rewards


def gsm8k(ex: ExampleArguments):
    from datasets import load_dataset

    data = load_dataset(ex.dataset_name, ex.dataset_config, split="train")
    if ex.max_train_samples is not None:
        data = data.select(range(min(ex.max_train_samples, len(data))))
    return data.map(lambda row: {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
        "answer": row["answer"].rsplit("####", 1)[-1].strip(),
    }, remove_columns=data.column_names)


def _tiny_module():
    spec = importlib.util.spec_from_file_location("ed_trl_tiny", pathlib.Path(__file__).with_name("tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(ex: ExampleArguments, args: EntropyDiscGRPOConfig) -> GRPOTrainer:
    """The trainer the flags describe: the subclass, or a stock GRPOTrainer with ``patch()``."""
    if ex.tiny:
        tiny = _tiny_module()
        tokenizer = tiny.tiny_tokenizer()
        model = tiny.tiny_model(tokenizer, hidden=ex.tiny_hidden, layers=ex.tiny_layers)
        dataset, reward = tiny.tiny_dataset(256), tiny.digit_reward
    else:
        tokenizer = AutoTokenizer.from_pretrained(ex.model_name_or_path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(
            ex.model_name_or_path, dtype=torch.bfloat16 if args.bf16 else torch.float32
        )
        dataset, reward = gsm8k(ex), accuracy_reward
    kwargs = dict(model=model, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer)
    if not ex.use_patch:
        return EntropyDiscGRPOTrainer(args=args, **kwargs)
    # A stock GRPOTrainer given an EntropyDiscGRPOConfig acts on its entropy_disc_* fields (building the
    # config installs the wrappers); patch() with no config says so explicitly and takes the args' settings.
    patch()
    return GRPOTrainer(args=args, **kwargs)


def save_first_batch(path: str) -> None:
    """Save the first batch the adapter masks (its ``EntropyDiscConfig.compute_mask`` inputs) to ``path``.

    For choosing mu (docs/choosing-mu.md): ``entropy-discriminator suggest-mu --batch PATH`` then gives the mu that
    clips a target share of it.  Wraps the config class's method for this process only; later batches are not saved.
    """
    original = EntropyDiscConfig.compute_mask

    def compute_mask(self: EntropyDiscConfig, *, advantages, valid, s_star=None, s_centered=None, **kwargs):
        if not pathlib.Path(path).exists() and s_star is not None and s_centered is not None:
            save_batch(path, s_star=s_star, s_centered=s_centered, advantages=advantages, valid=valid)
        return original(self, advantages=advantages, valid=valid, s_star=s_star, s_centered=s_centered, **kwargs)

    EntropyDiscConfig.compute_mask = compute_mask


def effect(history: list[dict]) -> str:
    """One line: the clipped share over the logged steps and the token entropy at the first and last step."""
    rows = [h for h in history if "entropy_disc/entropy/mean" in h]
    if not rows:
        return "no entropy_disc/* metrics were logged"
    frac = [h.get("entropy_disc/clip/frac", 0.0) for h in rows]
    return (f"clipped {sum(frac) / len(frac):.2%} of the tokens (mean over {len(rows)} steps); entropy "
            f"{rows[0]['entropy_disc/entropy/mean']:.3f} -> {rows[-1]['entropy_disc/entropy/mean']:.3f} nats/token")


def summarise(history: list[dict]) -> dict[str, dict[str, float]]:
    """First and last logged values of the headline metrics."""
    keys = ("reward", "entropy", "entropy_disc/entropy/mean", "entropy_disc/clip/frac", "entropy_disc/clip/n_clipped",
            "entropy_disc/tokens/valid", "entropy_disc/s_star/std")
    rows = [h for h in history if "reward" in h]
    if not rows:
        return {}
    return {"first": {k: rows[0][k] for k in keys if k in rows[0]},
            "last": {k: rows[-1][k] for k in keys if k in rows[-1]},
            "mean": {k: sum(r[k] for r in rows if k in r) / max(1, sum(k in r for r in rows)) for k in keys}}


def main(argv: list[str] | None = None) -> dict:
    parser = TrlParser((ExampleArguments, EntropyDiscGRPOConfig), allow_abbrev=False)
    parser.set_defaults(  # a reasonable single-GPU GSM8K run; every one can be overridden by a flag
        learning_rate=1e-6, num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_completion_length=512, max_steps=200, logging_steps=1, beta=0.0, temperature=1.0,
        disable_dropout=True, report_to="none",
    )
    given = sys.argv[1:] if argv is None else argv
    if "--tiny" in given:  # minutes, not hours, on a CPU, with a learning rate at which entropy moves
        parser.set_defaults(max_completion_length=16, max_steps=TINY_STEPS, learning_rate=TINY_LR)
        if any(method in given for method in ("clip_b", "clip_v")):
            parser.set_defaults(entropy_disc_mu_low=TINY_MU)
    ex, args = parser.parse_args_and_config(args=argv)
    if ex.save_batch:
        save_first_batch(ex.save_batch)
    trainer = build(ex, args)
    trainer.train()
    summary = summarise(trainer.state.log_history)
    if trainer.accelerator.is_main_process:
        print(json.dumps({"method": args.entropy_disc_method, **summary}, indent=1))
        print(f"{args.entropy_disc_method}: {effect(trainer.state.log_history)}")
        if ex.summary_json:
            pathlib.Path(ex.summary_json).write_text(json.dumps(
                {"method": args.entropy_disc_method, "summary": summary, "log_history": trainer.state.log_history},
                indent=1))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
