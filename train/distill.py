"""`accelerate launch train/distill.py --config train/configs/RECIPE.yaml [--key=value ...] [--resume]`:
the trainer's entry point, speculators/distill.py, run as a script."""

from speculators.distill import main

if __name__ == "__main__":
    main()
