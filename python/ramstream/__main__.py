"""python -m ramstream: the command line (see ramstream.cli)."""

import sys

from .cli import main

sys.exit(main())
