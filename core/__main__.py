"""``python -m alignzoo ...`` (and ``torchrun --nproc-per-node N -m alignzoo run ...``): the CLI."""

from alignzoo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
