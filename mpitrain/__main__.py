"""``python -m mpitrain`` is the ``mpitrain`` command."""

import sys

from mpitrain.cli import main

sys.exit(main())
