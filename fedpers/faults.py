"""The grammar of run-config key ``fault-injection``: which clients misbehave, how, when.

A spec is comma-separated entries ``kind[=value]:partitions[@round]``:

- ``partitions``: one id (``3``), an inclusive range (``0-9``) or ids joined by ``+``
  (``1+4+7``); ids are plain decimal numbers of at most ``MAX_DIGITS`` digits, and a
  range is kept as a ``range``, never expanded (``0-999999999`` costs no more than
  ``0-3``);
- ``@round``: only in that round (start-up queries count as round 0); without it, in
  every round;
- ``=value``: the kind's parameter (a number), where it has one; else its default.

``fedpers.config`` checks a spec before a run starts; ``clients/faults.py`` acts on it.
The kinds are listed in ``KINDS``, with their parameters' defaults.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultTargets:
    """The arrays of a family's replies that its fault kinds aim at
    (``FamilySpec.fault_targets``): ``responsibilities`` (kinds ``responsibilities`` and
    ``responsibilities-shape``), ``second_moments`` (``non-psd``, ``asymmetric``) and
    ``relayed`` (``pilots-scale``, ``pilots-nan``: what an agent relays to its
    neighbours). A name ending in ``.`` stands for every array it prefixes."""

    responsibilities: tuple[str, ...] = ()
    second_moments: tuple[str, ...] = ()
    relayed: tuple[str, ...] = ()

    def select(self, role: tuple[str, ...], names: Iterable[str]) -> list[str]:
        """The ``names`` that ``role`` (one of the fields) aims at, in their order."""
        prefixes = tuple(n for n in role if n.endswith("."))
        return [n for n in names if n in role or n.startswith(prefixes)]


# kind -> default parameter (None: the kind takes none)
KINDS: dict[str, float | None] = {
    # failures
    "raise": None,  # the ClientApp raises (an error reply)
    "sleep": None,  # no reply within round-timeout
    # malformed training replies
    "nan": None,  # every array NaN
    "shape": None,  # the first array gets an extra row
    "dtype": None,  # every array float16
    "rename": None,  # the first array under another name
    "extra": None,  # one array more than expected
    "drop": None,  # the first array left out
    "corrupt-data": None,  # an array's bytes are another array's; shape and dtype claimed
    "bad-stype": None,  # an array claims a serialization that is not numpy
    "examples-list": None,  # num-examples sent as a list
    "loss-list": None,  # loss sent as [NaN]
    "zero-examples": None,  # num-examples = 0
    "huge": 1e30,  # every array filled with this value
    # attacks on the shared model
    "sign-flip": 1.0,  # the update w - w_t sent as -scale (w - w_t)
    "noise": 1.0,  # Gaussian noise of this standard deviation added to the model's arrays
    "inflate": 1e12,  # num-examples claimed
    # a device that breaks distributed DP (dp = "distributed")
    "dp-no-noise": None,  # the update clipped but sent without its share of the noise
    "dp-no-clip": None,  # the update noised but not clipped
    # attacks on the mixtures (FedEM, FedGMM)
    "responsibilities": -1e6,  # every responsibility (gamma) set to this value
    "responsibilities-shape": None,  # responsibilities with an extra row
    "non-psd": None,  # second-moment statistics made indefinite (symmetric)
    "asymmetric": None,  # second-moment statistics made asymmetric
    # attacks on start-up queries and on Sheaf-FRL's relay
    "startup-scale": 1e9,  # every array of a start-up answer times this value
    "startup-nan": None,  # every array of a start-up answer NaN
    "startup-width": None,  # every 2-D array of a start-up answer one column wider
    "pilots-scale": 1e6,  # relayed pilots (own, transported; projections) times this value
    "pilots-nan": None,  # relayed pilots (own, transported; projections) NaN
}
FAULT_KINDS = tuple(KINDS)


MAX_DIGITS = 18  # an id or a round: below 10**18, so int() is cheap and never refused
_NUMBER = f"[0-9]{{1,{MAX_DIGITS}}}"
_ONE = re.compile(_NUMBER)
_RANGE = re.compile(f"({_NUMBER})-({_NUMBER})")
_LIST = re.compile(f"{_NUMBER}(?:\\+{_NUMBER})+")


@dataclass(frozen=True)
class Fault:
    """One entry of a ``fault-injection`` spec.

    ``partitions`` holds the ids as ranges (``0-9``: ``range(0, 10)``; ``1+4``: two
    ranges of one id), so that checking a partition costs one comparison per range,
    whatever the range's size. ``entry`` is the entry's text, for error messages.
    """

    kind: str
    value: float | None
    partitions: tuple[range, ...]
    round: int | None
    entry: str = field(default="", compare=False)

    def applies(self, partition: int, server_round: int) -> bool:
        """Whether ``partition`` misbehaves this way in ``server_round``."""
        hit = any(partition in ids for ids in self.partitions)
        return hit and self.round in (None, server_round)

    @property
    def highest(self) -> int:
        """The highest partition id the entry names."""
        return max(ids[-1] for ids in self.partitions)


def parse_faults(spec: str) -> list[Fault]:
    """``"raise:3@2,sign-flip=10:0-9"`` -> the entries as ``Fault``s.

    Raises
    ------
    ValueError
        On an entry that does not follow ``kind[=value]:partitions[@round]``, an unknown
        kind, or a value for a kind that takes none; the message names the entry.
    """
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, target = item.partition(":")
        kind, has_value, text = head.partition("=")
        where, _, at = target.partition("@")
        partitions = _partitions(where)
        if (
            kind not in KINDS
            or partitions is None
            or (at and not _ONE.fullmatch(at))
            or (has_value and KINDS[kind] is None)
        ):
            raise ValueError(
                f"entry '{item}' is not kind[=value]:partitions[@round], kind one of "
                f"{', '.join(FAULT_KINDS)} (a value only where the kind takes one; ids "
                f"and rounds are decimal numbers of at most {MAX_DIGITS} digits, a range "
                "low-high has low <= high)"
            )
        try:
            value = float(text) if has_value else KINDS[kind]
        except ValueError:
            raise ValueError(f"entry '{item}': '{text}' is not a number") from None
        faults.append(Fault(kind, value, partitions, int(at) if at else None, item))
    return faults


def _partitions(text: str) -> tuple[range, ...] | None:
    """``3``, ``0-9`` or ``1+4+7`` as ranges of ids; None if it is none of these."""
    if _ONE.fullmatch(text):
        return (range(int(text), int(text) + 1),)
    if (bounds := _RANGE.fullmatch(text)) is not None:
        low, high = int(bounds[1]), int(bounds[2])
        return (range(low, high + 1),) if low <= high else None
    if _LIST.fullmatch(text):
        return tuple(range(int(p), int(p) + 1) for p in text.split("+"))
    return None
