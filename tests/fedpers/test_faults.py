"""The fault-injection grammar (run-config key ``fault-injection``)."""

import pytest

from fedpers.faults import FAULT_KINDS, parse_faults


def test_entries_parse_to_kind_partition_and_round() -> None:
    assert parse_faults("raise:3@2, nan:5,,") == [("raise", 3, 2), ("nan", 5, None)]
    assert parse_faults("") == []
    assert [kind for kind, _, _ in parse_faults(",".join(f"{k}:0" for k in FAULT_KINDS))] == list(
        FAULT_KINDS
    )


@pytest.mark.parametrize("spec", ["explode:1", "nan", "nan:x", "nan:1@two", "nan:-1"])
def test_a_bad_entry_is_named(spec: str) -> None:
    with pytest.raises(ValueError, match="is not kind:partition\\[@round\\]"):
        parse_faults(spec)
