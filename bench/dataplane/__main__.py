"""`python -m bench.dataplane`: see bench/dataplane/__init__.py."""

import sys

from .cli import main

sys.exit(main())
