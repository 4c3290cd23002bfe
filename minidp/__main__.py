"""``python -m minidp <command>``: the command line lives in :mod:`minidp.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
