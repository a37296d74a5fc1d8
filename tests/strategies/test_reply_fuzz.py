"""Property-based fuzzing of what one client sends (hypothesis): replies generated from
the record grammar in place of one node's training or evaluation reply, for every
family, through the round loop's own steps on real ClientApps in process. The grammar
and the properties (docs/architecture.md, "What the server guarantees") are
``fedpers.simulations.reply_fuzz``'s: no exception escapes, the adopted state is well
formed and adopted, the reply's weight and values stay within the stated bounds, and a
rejection names the partition and a reason.

A fixed budget and seed keep it fast in make test; ``FEDPERS_FUZZ_EXAMPLES`` raises the
budget, and ``simulations.robustness`` runs the long sweep, counting instead of
stopping at the first violation."""

from __future__ import annotations

import os

import pytest
from flwr.app import MessageType, RecordDict
from hypothesis import HealthCheck, example, given, settings

from fedpers.simulations import reply_fuzz
from fedpers.simulations.reply_fuzz import (
    FAMILIES,
    STARTUP_FAMILIES,
    STATISTICS_QUERIES,
    evaluation_violations,
    federation,
    least_integer_statistics,
    replies,
    scaled_statistics,
    smuggled,
    startup,
    startup_answers,
    startup_violations,
    statistics_startup,
    statistics_violations,
    training_violations,
)

EXAMPLES = int(os.environ.get("FEDPERS_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_training_reply_breaks_the_round_or_exceeds_its_bounds(family: str) -> None:
    fed = federation(family)
    template = fed.template(MessageType.TRAIN)

    @FUZZ
    @given(content=replies(template))
    def check(content: RecordDict) -> None:
        found, _ = training_violations(fed, content)
        assert not found, found

    check()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_evaluation_reply_breaks_the_round_or_exceeds_its_bounds(family: str) -> None:
    fed = federation(family)
    template = fed.template(MessageType.EVALUATE)

    @FUZZ
    @given(content=replies(template))
    @example(content=smuggled(template))  # the class's example: a MetricRecord first
    def check(content: RecordDict) -> None:
        found, _ = evaluation_violations(fed, content)
        assert not found, found

    check()


@pytest.mark.parametrize("family", STARTUP_FAMILIES)
def test_no_startup_answer_chooses_the_initial_model_or_blocks_the_vote(family: str) -> None:
    """One node of four answers the vote on the initial model (its digest, then its
    arrays if asked) with generated answers, or a coherent model of its own with that
    model's digest: the vote still chooses the honest model, rejects no honest node,
    and raises nothing."""
    harness = startup(family)

    @FUZZ
    @given(answers=startup_answers(harness))
    def check(answers: dict[bool, RecordDict]) -> None:
        found, _ = startup_violations(harness, answers)
        assert not found, found

    check()


@pytest.mark.parametrize("query", STATISTICS_QUERIES)
def test_no_startup_statistics_break_fedgmms_initial_state(query: str) -> None:
    """One node of four answers one of FedGMM's start-up statistics queries (pooled PCA
    moments, k-means centroids, the statistics nearest each initial mean) with a
    generated answer: the start-up raises nothing, the initial state is well formed
    (the honest state's arrays, finite, covariances positive definite) and within
    ``STARTUP_BOUND`` of the honest state's scale, and no honest node is rejected."""
    harness = statistics_startup()
    template = harness.templates[query]

    @FUZZ
    @given(answer=replies(template))
    @example(answer=scaled_statistics(template, 1e8))  # in shape, counts and type
    @example(answer=least_integer_statistics(template))  # int64 arithmetic wraps around
    def check(answer: RecordDict) -> None:
        found, _ = statistics_violations(harness, query, answer)
        assert not found, found

    check()


def test_the_sweep_counts_a_broken_bound_instead_of_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep's counters can fail: with the server's weight cap lifted, an inflated
    weight is kept above the bound computed here, and the sweep counts it and goes on."""
    fed = federation("fedavg")
    monkeypatch.setattr(fed, "bound", lambda *, test: 0.5)  # no positive weight is under it
    count = reply_fuzz.sweep_phase(fed, "fedavg", MessageType.TRAIN, examples=60, seed=0)
    assert count.replies == 60
    assert count.exceptions == 0
    # every kept reply of positive weight breaks it (a kept reply may weigh 0)
    assert 0 < count.violations[reply_fuzz.BOUND] <= count.kept
    assert all(e.startswith(reply_fuzz.BOUND) for e in count.examples)
