"""simulations.server_cost times FedAMP's server two ways and finds their messages
equal (the figures themselves are the benchmark's); bad flags are refused first."""

from __future__ import annotations

import pytest

from fedpers.simulations import server_cost


def test_server_cost_prints_both_ways_with_equal_messages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert server_cost.main(["--clients", "30", "--fraction", "0.2", "--reps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FedAMP's server, mnist1d-mlp, 30 clients, 6 sampled a round")
    rows = {line[:16].strip(): line[16:].split() for line in out[2:4]}
    assert list(rows) == ["one at a time", "all at once"]
    assert rows["one at a time"][2] == rows["all at once"][2]  # the arrays' digest
    assert out[4].endswith("arrays sent equal")


@pytest.mark.parametrize(("flag", "value"), [("--clients", "0"), ("--fraction", "0")])
def test_server_cost_refuses_bad_flags(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        server_cost.main([flag, value])
    assert flag in capsys.readouterr().err
