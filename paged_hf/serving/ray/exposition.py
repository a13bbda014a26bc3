"""One Prometheus exposition out of every replica's `/metrics`: each sample labelled `replica="<name>"`.

The text format wants each metric family's `# HELP`/`# TYPE` once, with all its samples after it: the
replicas' texts are split into families and joined family by family.
"""

from __future__ import annotations


def label_samples(text: str, replica: str) -> dict[str, tuple[list[str], list[str]]]:
    """family name -> (its comment lines, its samples with the replica label), in the text's order."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    current = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = parts[2]
            families.setdefault(current, ([], []))[0].append(line)
            continue
        families.setdefault(current, ([], []))[1].append(_with_label(line, replica))
    return families


def _with_label(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    name_end = _name_length(sample)
    name, rest = sample[:name_end], sample[name_end:]
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}" if not rest.startswith("{}") else f"{name}{{{label}}}{rest[2:]}"
    return f"{name}{{{label}}}{rest}"


def _name_length(sample: str) -> int:
    for i, char in enumerate(sample):
        if not (char.isalnum() or char in "_:"):
            return i
    return len(sample)


def merge_expositions(texts: dict[str, str]) -> str:
    """replica name -> its /metrics text  ->  one text, every sample labelled with its replica."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family, (comments, samples) in label_samples(text, replica).items():
            entry = merged.setdefault(family, (comments, []))
            entry[1].extend(samples)
    lines = []
    for comments, samples in merged.values():
        lines += comments + samples
    return "\n".join(lines) + "\n"
