"""``python -m hs_dataset.cli``: the ``hs-dataset`` command."""

from hs_dataset.cli import run

run()
