"""`python -m paged_hf ...` is the `paged-hf` command."""

import sys

from .cli import main

sys.exit(main())
