"""``python -m lazyrag.cli ...`` (and ``torchrun ... -m lazyrag.cli ...``) does what the ``lazyrag`` command does."""

import sys

from lazyrag.cli import main

sys.exit(main())
