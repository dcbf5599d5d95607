"""``python -m lazyrag ...`` does what the ``lazyrag`` command does."""

import sys

from lazyrag.cli import main

if __name__ == "__main__":  # importing it (the wheel check imports every module) runs nothing
    sys.exit(main())
