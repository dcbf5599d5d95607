"""``python -m lazyrag ...`` does what the ``lazyrag`` command does."""

import sys

from lazyrag.cli import main

sys.exit(main())
