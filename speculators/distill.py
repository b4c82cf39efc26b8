"""Distill a speculator from its target.

    speculators train mlp_quick [--key=value ...] [--resume]            # a shipped recipe, or a YAML path
    accelerate launch train/distill.py --config train/configs/mlp_quick.yaml [--key=value ...] [--resume]
    accelerate launch -m speculators.distill --config RECIPE.yaml ...    # the same, without a checkout
    python train/distill.py --config train/configs/mlp_quick.yaml ...     # one process, no launcher

Any recipe key can be overridden on the command line (`--lr=3e-4`, `--report-to wandb`).
Bad input ends in one line on stderr, `distill: error: ...`, and exit code 2, before anything is
written. Under `accelerate launch` the same line is printed, but the launcher exits 1 whatever code
its processes exit with: it raises CalledProcessError (one process) or torch's ChildFailedError
(--multi_gpu) and prints that traceback after our line. `accelerate launch -q` leaves the traceback
out (with --multi_gpu torch still prints its failure summary).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speculators.assets import AssetError
from speculators.config import ConfigError, TrainConfig, load_config
from speculators.runtime import configure_process


def check_target(cfg: TrainConfig) -> None:
    """The target's config, read before any weights: a causal LM whose window (max_position_embeddings)
    holds the recipe's sequences. Past it a model computes positions it was never trained on, silently."""
    from speculators.target import context_window, model_config

    window = context_window(model_config(cfg.target))
    if not window:
        return
    if cfg.seq_len > window:
        raise ConfigError(f"seq_len={cfg.seq_len} is longer than the target's window of {window} tokens "
                          f"(max_position_embeddings); lower seq_len")
    for s in cfg.stages:
        if (s.data != "dataset" or s.onpolicy_fraction) and s.prompt_tokens + s.gen_tokens > window:
            raise ConfigError(f"stage {s.name}: prompt_tokens + gen_tokens = {s.prompt_tokens + s.gen_tokens} is "
                              f"longer than the target's window of {window} tokens (max_position_embeddings)")


def check_recipe(config: str | None, overrides: list[str], resume: bool) -> TrainConfig:
    """The recipe with its overrides, its output_dir, its data set and its target's config, checked before
    the trainer starts (and by `speculators train` before it launches any process)."""
    cfg = load_config(config, overrides)
    out = Path(cfg.output_dir)
    if not resume and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"output_dir {out} is not empty; pass --resume to continue it or choose another")
    from speculators.data import check_source

    check_source(cfg.data)
    check_target(cfg)
    return cfg


def main():
    configure_process()  # before torch's first matrix product and before huggingface_hub is imported
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a recipe: a YAML file (the shipped ones are in train/configs/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    args, overrides = parser.parse_known_args()
    try:
        cfg = check_recipe(args.config, overrides, args.resume)
        from speculators.trainer import Trainer

        final = Trainer(cfg, resume=args.resume).train()
    except (AssetError, ValueError, FileNotFoundError) as err:
        print(f"distill: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"final speculator: {final}")


if __name__ == "__main__":
    main()
