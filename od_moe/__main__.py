"""`python -m od_moe ...` is the `od-moe` command."""

import sys

from .cli import main

sys.exit(main())
