"""``python -m hs_dataset.cli``: the ``hs-dataset`` command."""

import sys

from hs_dataset.cli import main

sys.exit(main())
