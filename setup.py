"""Package discovery; everything else is in pyproject.toml.

`kernels/` and `integrations/` install as `paged_hf.kernels` and `paged_hf.integrations` (the package-dir
mapping in pyproject.toml), never as top-level packages. Neither folder has an `__init__.py`, so from the
checkout's root neither stands in for a package of its own name (HF's `kernels`); paged_hf/source_layout.py
finds them there. The three roots are listed by name and every folder with an `__init__.py` under them is found,
so a new subpackage (e.g. `paged_hf/server`) can never be left out of the wheel.
"""

from setuptools import find_packages, setup

#: import name -> folder it lives in (pyproject.toml's [tool.setuptools.package-dir] says the same)
ROOTS = {"paged_hf": "paged_hf", "paged_hf.kernels": "kernels", "paged_hf.integrations": "integrations"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages())
