"""``python -m deepep_cupy.tuning``: see :mod:`deepep_cupy.tuning.cli`."""

import sys

from .cli import main

sys.exit(main())
