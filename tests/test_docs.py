"""README and docs/ stand on their own: every file they name is in the repository, none lies outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: `some/path.ext` or ](some/path.ext) naming a file of the repository (or outside it)
#: where a relative path may start (kernels/csrc/... is also named as csrc/...)
BASES = [ROOT, ROOT / "paged_hf", ROOT / "kernels", ROOT / "integrations"]
REFERENCE = re.compile(r"[`(]((?:\.\./|\./)?(?:[\w.-]+/)*[\w.-]+\.(?:md|py|cpp|toml|png|json))[`)#]")


def test_readme_and_docs_name_only_files_inside_the_repository():
    problems = []
    for page in PAGES:
        for target in REFERENCE.findall(page.read_text()):
            if target.startswith("../") or ".." in Path(target).parts:
                problems.append(f"{page.name}: {target} lies outside the repository")
            elif "/" in target and not any((base / target).exists() for base in BASES + [page.parent]):
                problems.append(f"{page.name}: {target} does not exist")
    assert not problems, problems


def test_the_public_contract_is_in_docs():
    readme = (ROOT / "README.md").read_text()
    assert "docs/api.md" in readme and "docs/errors.md" in readme
