"""Distill a speculator from its target.

    accelerate launch train/distill.py --config train/configs/mlp_quick.yaml [--key=value ...] [--resume]

Any recipe key can be overridden on the command line (`--lr=3e-4`, `--report-to wandb`).
Bad input ends in one line on stderr and exit code 2.
"""

import argparse
import sys

from speculators.assets import AssetError
from speculators.config import load_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a recipe in train/configs/")
    parser.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    args, overrides = parser.parse_known_args()
    try:
        cfg = load_config(args.config, overrides)
        from speculators.trainer import Trainer

        final = Trainer(cfg, resume=args.resume).train()
    except (AssetError, ValueError, FileNotFoundError) as err:
        print(f"distill: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"final speculator: {final}")


if __name__ == "__main__":
    main()
