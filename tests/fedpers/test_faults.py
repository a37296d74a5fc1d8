"""The fault-injection grammar (run-config key ``fault-injection``)."""

import pytest

from fedpers.faults import FAULT_KINDS, KINDS, Fault, parse_faults


def test_entries_parse_to_kind_value_partitions_and_round() -> None:
    assert parse_faults("raise:3@2, nan:5,,") == [
        Fault("raise", None, (range(3, 4),), 2),
        Fault("nan", None, (range(5, 6),), None),
    ]
    assert parse_faults("") == []
    assert parse_faults("sign-flip=10:0-3") == [Fault("sign-flip", 10.0, (range(0, 4),), None)]
    assert parse_faults("inflate:1+4@0") == [Fault("inflate", 1e12, (range(1, 2), range(4, 5)), 0)]
    kinds = [fault.kind for fault in parse_faults(",".join(f"{k}:0" for k in FAULT_KINDS))]
    assert kinds == list(FAULT_KINDS)
    assert all(f.value == KINDS[f.kind] for f in parse_faults(",".join(f"{k}:0" for k in KINDS)))


def test_a_fault_applies_to_its_partitions_and_round() -> None:
    (fault,) = parse_faults("noise=0.5:2-4@7")
    assert fault.applies(3, 7)
    assert not fault.applies(5, 7)
    assert not fault.applies(3, 6)
    (always,) = parse_faults("raise:1")
    assert always.applies(1, 0)
    assert always.applies(1, 99)


@pytest.mark.parametrize(
    "spec",
    ["explode:1", "nan", "nan:x", "nan:1@two", "nan:-1", "nan=3:1", "sign-flip=x:1", "noise:4-2"],
)
def test_a_bad_entry_is_named(spec: str) -> None:
    with pytest.raises(ValueError, match=spec.split(",")[0].replace("+", "\\+")):
        parse_faults(spec)
