"""simulations.robustness's plan, before any run: the attack table's runs at each count
of replies per round, the selection flags, and bad flags refused with the fix, leaving
no output directory behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fedpers.aggregation import Aggregation
from fedpers.simulations import robustness
from fedpers.simulations.inprocess import InProcessSimulation


def test_the_full_table_runs_every_cell_at_4_10_and_40_replies() -> None:
    runs = robustness.attack_runs(False, 10.0, Path("/r"), (0,), {}, (4, 10, 40))
    aggregations = len(Aggregation)
    # FedRep: clean and both attacks under every aggregation; FedAvg: clean under the
    # mean, both attacks under every aggregation
    per_count = 3 * aggregations + (1 + 2 * aggregations)
    assert len(runs) == 3 * per_count
    assert len({r["run-name"] for r in runs}) == len(runs)
    for count in (4, 10, 40):
        mine = [r for r in runs if f"-r{count}-" in r["run-name"]]
        assert len(mine) == per_count
        # fraction-train x clients is the count, exactly as the strategy rounds it
        assert {round(r["fraction-train"] * r["num-clients"]) for r in mine} == {count}
    # 10 replies: the configuration the table had before the count became a dimension
    ten = next(r for r in runs if r["run-name"] == "fedrep-r10-sign-flip-mean-seed0")
    assert (ten["num-clients"], ten["fraction-train"]) == (100, 0.1)
    assert ten["fault-injection"] == "sign-flip=10:0-9"


def test_the_selection_keeps_only_the_chosen_cells() -> None:
    selection = robustness.Selection(
        frozenset({"fedrep"}), frozenset({"mean", "trimmed-mean"}), frozenset({"sign-flip"})
    )
    runs = robustness.attack_runs(False, 10.0, Path("/r"), (0, 1), {}, (4, 40), selection)
    assert sorted(r["run-name"] for r in runs) == sorted(
        f"fedrep-r{c}-sign-flip-{a}-seed{s}"
        for c in (4, 40)
        for a in ("mean", "trimmed-mean")
        for s in (0, 1)
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--attacks", "clean,bogus"], "unknown bogus; choose from clean,sign-flip"),
        (["--aggregations", "mode"], "unknown mode"),
        (["--replies-per-round", "4,0"], "give replies per round as 4,10,40"),
        (["--sweep-replies", "-1"], "is not a count"),
        (["--exchange-rows", "pfedme,fedavg"], "unknown fedavg; choose from scaffold,"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        robustness.main(["--out", str(out), *flags])
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.long
def test_in_process_attack_runs_match_a_run_in_this_process(tmp_path: Path) -> None:
    """--in-process hands each attack run to a fresh process (spawned, one run each) and
    puts its result in the table: the same final accuracy, to the bit, as the same run
    in this process (which the scripts' tests check against flwr run)."""
    flags = ["--quick", "--skip-fuzz", "--skip-exchanges", "--sweep-replies", "0"]
    flags += ["--in-process", "--replies-per-round", "10", "--algorithms", "fedavg"]
    flags += ["--attacks", "clean"]
    summary = robustness.main(["--out", str(tmp_path / "pool"), *flags, "--parallel", "2"])
    assert summary["fuzz"] == {}  # skipped: nothing, not a clean sweep of zero cases
    assert summary["exchanges"] == {}
    assert not (tmp_path / "pool" / "cases.json").exists()
    [run] = robustness.attack_runs(
        True,
        10.0,
        tmp_path / "here",
        (0,),
        {},
        (10,),
        robustness.Selection(frozenset({"fedavg"}), frozenset({"mean"}), frozenset({"clean"})),
    )
    directory = InProcessSimulation().run(run)
    expected = json.loads((directory / "summary.json").read_text())["final_accuracy"]
    assert summary["attack"]["10"]["fedavg"]["clean"] == expected
    table = (tmp_path / "pool" / "table.md").read_text()
    assert "# Fuzz sweep" not in table
    assert "# Attacks" in table
    assert "# Attacks over a run" not in table


def test_the_attacks_over_a_run_cover_every_row_with_its_own_exchange() -> None:
    from fedpers.simulations import exchange_attacks

    runs, refused = exchange_attacks.plan(
        quick=False, scale=10.0, runs_dir=Path("/r"), seeds=(0, 1)
    )
    assert refused == {}
    rows = {
        "scaffold", "fed-mtl", "fedproto", "clustered-fl", "pfedme", "l2gd", "pfedme-fedem",
        "fedgmm", "fedamp", "pfedhn",
    }  # fmt: skip
    assert {r["algorithm"] for r in runs} == rows
    # clean and attacked under every aggregation, each seed: 50 rounds of 10 clients
    # that all train, client 0 attacking in every round
    assert len(runs) == len(rows) * 2 * len(Aggregation) * 2
    assert len({r["run-name"] for r in runs}) == len(runs)
    for run in runs:
        assert (run["num-clients"], run["fraction-train"], run["num-rounds"]) == (10, 1.0, 50)
        assert run["fault-injection"] in ("", "sign-flip=10:0")
        assert (run["fault-injection"] == "") == ("-clean-" in run["run-name"])


def test_the_chosen_rows_of_the_attacks_over_a_run_are_run_in_the_tables_order() -> None:
    from fedpers.simulations import exchange_attacks

    args = ["--out", "/r", "--exchange-rows", "pfedme,clustered-fl"]
    chosen = robustness._parser().parse_args(args).exchange_rows
    runs, _ = exchange_attacks.plan(
        quick=True, scale=10.0, runs_dir=Path("/r"), seeds=(0,), rows=sorted(chosen)
    )
    assert [r["algorithm"] for r in runs[:: len(runs) // 2]] == ["clustered-fl", "pfedme"]
    assert len(runs) == 2 * 2 * len(exchange_attacks.QUICK_AGGREGATIONS)


def test_an_aggregation_a_row_refuses_is_listed_with_its_reason_and_not_run() -> None:
    from fedpers.simulations import exchange_attacks

    # a trim of 0.45 cuts 5 of the 10 replies at each end: the trimmed mean keeps none
    runs, refused = exchange_attacks.plan(
        quick=False,
        scale=10.0,
        runs_dir=Path("/r"),
        seeds=(0,),
        values={"aggregation-trim": 0.45},
    )
    assert set(refused) == set(exchange_attacks.ROWS)
    for reasons in refused.values():
        assert list(reasons) == ["trimmed-mean"]
        assert "leaving none" in reasons["trimmed-mean"]
    assert "trimmed-mean" not in {r["aggregation"] for r in runs}
    assert len(runs) == len(exchange_attacks.ROWS) * 2 * (len(Aggregation) - 1)


def test_a_setting_that_every_run_of_a_row_refuses_stops_before_anything_runs() -> None:
    from fedpers.simulations import exchange_attacks

    with pytest.raises(SystemExit, match=r"the attack over a run of scaffold: .*num-rounds"):
        exchange_attacks.plan(quick=True, scale=10.0, runs_dir=Path("/r"), seeds=(0,), rounds=0)


def test_the_table_says_how_often_an_attacked_run_went_back(tmp_path: Path) -> None:
    import numpy as np

    from fedpers.results import RoundRecord
    from fedpers.simulations import exchange_attacks

    runs, directories = [], []
    for attack, fault, back in (("clean", "", ()), ("sign-flip", "sign-flip=10:0", (2, 4))):
        name = f"exchange-pfedme-{attack}-mean-seed0"
        directory = tmp_path / name
        directory.mkdir()
        records = [
            RoundRecord(
                round=r, seconds=1.0, server={"rolled-back-to": r - 2.0} if r in back else {}
            )
            for r in range(1, 6)
        ]
        (directory / "rounds.jsonl").write_text(
            "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
        )
        (directory / "summary.json").write_text(json.dumps({"final_accuracy": 0.5}))
        np.savez(directory / "checkpoint.npz", w=np.array([1.0 if fault else 0.0]))
        runs.append(
            {
                "algorithm": "pfedme",
                "aggregation": "mean",
                "seed": 0,
                "fault-injection": fault,
                "num-rounds": 5,
                "results-dir": str(tmp_path),
                "run-name": name,
            }
        )
        directories.append(directory)
    table = exchange_attacks.summarize(runs, directories, {})
    assert table["pfedme"]["sign-flip"]["went_back"] == {"mean": 2}
    assert table["pfedme"]["clean"]["went_back"] == {"mean": 0}
    lines = exchange_attacks.section(table, 10.0)
    assert "| pfedme | sign-flip x10 | 50.00 (went back in 2 rounds) |" in "\n".join(lines)
    assert "| pfedme | none | 50.00 |" in "\n".join(lines)
