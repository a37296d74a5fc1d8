"""The grammar of run-config key ``fault-injection``: which client misbehaves, how, when.

A spec is comma-separated ``kind:partition[@round]`` entries; without ``@round`` the
fault happens every round. ``fedpers.config`` checks a spec before a run starts;
``clients/faults.py`` acts on it.
"""

from __future__ import annotations

FAULT_KINDS = ("raise", "sleep", "nan", "shape", "dtype")


def parse_faults(spec: str) -> list[tuple[str, int, int | None]]:
    """``"raise:3@2,nan:5"`` -> ``[("raise", 3, 2), ("nan", 5, None)]``.

    Raises
    ------
    ValueError
        On an entry that is not ``kind:partition[@round]`` with a kind of
        ``FAULT_KINDS``; the message names the entry.
    """
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, target = item.partition(":")
        partition, _, at = target.partition("@")
        if kind not in FAULT_KINDS or not partition.isdigit() or (at and not at.isdigit()):
            raise ValueError(
                f"entry '{item}' is not kind:partition[@round], kind one of "
                f"{', '.join(FAULT_KINDS)}"
            )
        faults.append((kind, int(partition), int(at) if at else None))
    return faults
