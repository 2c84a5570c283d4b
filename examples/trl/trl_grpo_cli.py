"""TRL's own ``trl grpo`` script with the entropy discriminator: every ``trl grpo`` flag plus ``--entropy_disc_*``.

``trl grpo`` builds a stock ``GRPOTrainer`` inside ``trl.scripts.grpo.main``; given an
``EntropyDiscGRPOConfig`` (which installs the adapter's wrappers when it is built) that trainer
applies Clip_B / Clip_V and logs the ``entropy_disc/`` metrics; ``unpatch()`` afterwards restores
the stock methods::

    python examples/trl/trl_grpo_cli.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/DeepMath-103K --reward_funcs accuracy_reward \\
        --output_dir out/trl_grpo_clip_b --entropy_disc_method clip_b
"""

from __future__ import annotations

import sys

from trl import DatasetMixtureConfig, ModelConfig, TrlParser
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.grpo import main as trl_grpo_main

from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, unpatch


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((GRPOScriptArguments, EntropyDiscGRPOConfig, ModelConfig, DatasetMixtureConfig), allow_abbrev=False)
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(args=argv)
    try:
        trl_grpo_main(script_args, training_args, model_args, dataset_args)
    finally:
        unpatch()


if __name__ == "__main__":
    main(sys.argv[1:])
