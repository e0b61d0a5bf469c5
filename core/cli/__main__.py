"""``python -m alignzoo.cli``: the ``alignzoo`` command."""

from alignzoo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
