"""TRL's own ``trl grpo`` script with the entropy discriminator: every ``trl grpo`` flag plus ``--entropy_disc_*``.

``trl grpo`` builds a stock ``GRPOTrainer`` inside ``trl.scripts.grpo.main``; a class-wide
``patch()`` before that call gives it Clip_B / Clip_V and the ``entropy_disc/`` metrics::

    python examples/trl/trl_grpo_cli.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/DeepMath-103K --reward_funcs accuracy_reward \\
        --output_dir out/trl_grpo_clip_b --entropy_disc_method clip_b
"""

from __future__ import annotations

import sys

from trl import DatasetMixtureConfig, ModelConfig, TrlParser
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.grpo import main as trl_grpo_main

from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, patch, unpatch


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((GRPOScriptArguments, EntropyDiscGRPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(args=argv)
    patch(config=training_args.entropy_disc_config(), mask_source=training_args.entropy_disc_mask_source)
    try:
        trl_grpo_main(script_args, training_args, model_args, dataset_args)
    finally:
        unpatch()


if __name__ == "__main__":
    main(sys.argv[1:])
