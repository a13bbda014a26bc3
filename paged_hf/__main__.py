"""`python -m paged_hf ...` is the `paged-hf` command."""

import sys

from paged_hf.entrypoints.cli import main

sys.exit(main())
