"""`paged_hf.kernels` and `paged_hf.integrations` in a checkout, where their folders sit beside `paged_hf/`.

The repository keeps `kernels/` and `integrations/` at its top level; a wheel installs them inside `paged_hf/`.
Neither folder has an `__init__.py`, so neither is a regular package of its own name: `python -c`, `python -m`,
a REPL and pytest put the working directory first on `sys.path`, where a regular package `kernels/` would stand
in for HuggingFace's `kernels` (which transformers imports from 5.25 on). A folder without `__init__.py` is only a
namespace portion there, and any installed package of the same name wins over it (transformers also reads such
a portion as "not installed").

Without an `__init__.py` the two are namespace packages inside a regular one, which setuptools' editable finder
maps but cannot import. So when they are not inside this package's folder (a checkout, installed editable or
used from its root), `register()` makes them namespace packages over the folders beside it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

#: the subpackages whose folders sit at the repository's top level in a checkout
TOP_LEVEL_FOLDERS = ("kernels", "integrations")


def register() -> None:
    """Make `paged_hf.<folder>` importable from the top-level folders where this package runs from a checkout."""
    here = Path(__file__).resolve().parent
    for folder in TOP_LEVEL_FOLDERS:
        name = f"{__package__}.{folder}"
        beside = here.parent / folder
        if name in sys.modules or (here / folder).is_dir() or not beside.is_dir():
            continue  # installed from a wheel (the folder is inside), or already registered
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(beside)]
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        setattr(sys.modules[__package__], folder, module)  # as an import sets a submodule on its package
