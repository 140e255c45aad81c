"""``python -m hs_dataset.cli``: the ``hs-dataset`` command."""

import sys

from . import main

sys.exit(main())
