"""The strategy every fedpers algorithm starts from, and the whole of most of them.

A personalized algorithm is a row of the algorithm table (``fedpers.algorithms``):
the parts of the model it shares are averaged here (weighted by ``num-examples``),
the parts it keeps never leave the device. What sits elsewhere:

- ``strategies.federation``: which node holds which partition, one send-and-collect;
- ``strategies.screening``: why a reply cannot be used (pure functions);
- ``strategies.rounds``: the round loop, which calls Flower's ``configure_train``,
  ``aggregate_train``, ``configure_evaluate`` and ``aggregate_evaluate`` as
  ``Strategy.start`` does;
- ``strategies.final_tests``: the tests after the last round (fine-tuned heads,
  unseen clients);
- ``strategies.private_release``: a private run's releases, clip and audit canaries
  (``private``);
- ``strategies.startup``: the queries before round 1 and the initial model's vote
  (``startup_part``).

Flower's four methods are real: a subclass written from Flower's documentation that
overrides them changes the run. By default they call fedpers' own hooks, which an
algorithm that needs more overrides instead: ``initial_arrays`` (what round 1 starts
from), ``train_contents`` (what each sampled client receives, ``configure_train``),
``evaluate_contents`` (``configure_evaluate``), ``checks`` (the screening of training
replies), ``combine``, ``final_test`` and ``round_metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedpers import privacy, protocol, records
from fedpers.aggregation import Aggregation, aggregate, trims_all
from fedpers.algorithms import FinalTest
from fedpers.checkpoint import ResumeError
from fedpers.config import LrSchedule, RunConfig
from fedpers.protocol import FinalTestResult
from fedpers.results import RoundRecord
from fedpers.seeding import rng
from fedpers.server_step import ServerStrategySettings
from fedpers.strategies import final_tests, screening
from fedpers.strategies.federation import Federation
from fedpers.strategies.flower_step import FlowerStep
from fedpers.strategies.private_release import PrivateRelease, audit_state
from fedpers.strategies.rounds import EvaluateFn, run_rounds
from fedpers.strategies.startup import Startup

logger = logging.getLogger(__name__)


class FedpersStrategy(Strategy):
    """Seeded sampling over a known population, shared parts averaged, every client
    evaluated with the global shared parts and its own personal parts.

    Parameters
    ----------
    run : RunConfig
        The run configuration; the strategy reads its algorithm row (``run.spec``:
        shared parts, final test), ``num-clients``, ``fraction-train``, ``seed``,
        ``lr-schedule``, ``num-rounds``, ``min-replies``, ``evaluate-every``,
        ``final-rounds``, ``unseen-fraction``, ``adapt-fraction``,
        ``finetune-epochs`` and ``round-timeout``.

    Notes
    -----
    Clients are evaluated every round (and always in the last ``final-rounds``) on
    ALL seen partitions, weighted by their test samples; runs of the linear model are
    evaluated on the server instead. Unseen partitions (the highest ids,
    ``unseen-fraction``) never train and are tested once after the last round.
    """

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.spec = run.spec
        self.shared = self.spec.shared
        self.federation = Federation(run.num_clients, weight_cap=run.weight_cap)
        self.evaluate_nodes = run.family.evaluates_clients
        self.seen = list(range(run.seen_clients))
        self.unseen = list(range(run.seen_clients, run.num_clients))
        self.startup_part = Startup(self.federation, run.vote_size)  # queries before round 1
        self.sent_arrays: dict[str, screening.ArraySpec] = {}
        self.current_shared: dict[str, np.ndarray] = {}  # what this round started from
        self.run_token = ""  # set by the ServerApp: the run's identity for snapshots
        self.privacy = privacy.run_mechanism(run)  # client-level DP, or None
        # its releases, clip and canaries (None in a run without DP)
        self.private = PrivateRelease(self.privacy) if self.privacy is not None else None
        self.sampled: list[int] = []  # the partitions sampled for this round's training
        # server-strategy: a Flower strategy combines the shared parts instead of combine()
        step = run.group(ServerStrategySettings)
        self.flower_step = FlowerStep(step) if step.server_strategy else None

    # ------------------------------------------------------------------ start-up
    def initial_arrays(self, grid: Grid, *, timeout: float) -> ArrayRecord:
        """The shared parts of the seeded initial model, as a majority of the nodes build
        it (``Startup.initial_model``); none for a row that shares nothing.

        Raises
        ------
        PopulationError
            If no group of nodes has more than half of the valid votes.
        """
        if not self.shared:
            return ArrayRecord()
        arrays = self.startup_part.initial_model(grid, timeout)
        return ArrayRecord({k: Array(records.contiguous(v)) for k, v in arrays.items()})

    def startup(
        self,
        grid: Grid,
        query: str,
        partitions: list[int],
        content: RecordDict,
        timeout: float,
        check: screening.Check | None = None,
    ) -> dict[int, dict[str, np.ndarray]]:
        """``Startup.ask``: the answers to a start-up ``query`` that pass screening."""
        return self.startup_part.ask(grid, query, partitions, content, timeout, check)

    def reject_at_startup(self, partition: int, reason: str) -> None:
        """Record that ``partition``'s answer to a start-up query was left out, and why."""
        self.startup_part.reject(partition, reason)

    @property
    def startup_rejections(self) -> tuple[str, ...]:
        """The start-up answers left out, with why (``partition P: query: reason``), in
        the order they came: the summary's ``startup_rejections``."""
        return self.startup_part.rejections

    # -------------------------------------------------------------------- sampling
    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round`` (sorted; seen clients only): drawn
        from the seed and the round, except in a private run with noise, whose sample
        is secret (``fedpers.privacy``), and Poisson under ``dp-sampling = "poisson"``."""
        mechanism = self.privacy
        if mechanism is not None and mechanism.secret:
            generator = privacy.secret_generator()
        else:
            generator = rng(self.run.seed, "sample", server_round)
        if mechanism is not None and mechanism.sampling is privacy.DpSampling.POISSON:
            self.sampled = privacy.poisson_sample(self.seen, mechanism.sampling_rate, generator)
        else:
            count = self.clients_to_train(server_round)
            chosen = generator.choice(self.seen, count, replace=False)
            self.sampled = sorted(int(p) for p in chosen)
        return self.sampled

    def clients_to_train(self, server_round: int) -> int:
        """How many clients ``sample`` draws in ``server_round`` (a fixed-size sample):
        ``clients_per_round``; a row whose rounds differ overrides it."""
        return self.run.clients_per_round

    def lr_factor(self, server_round: int) -> float:
        """Multiplier of the learning rate in ``server_round`` under the schedule."""
        if self.run.lr_schedule == LrSchedule.MILESTONES:
            if server_round > 0.75 * self.run.num_rounds:
                return 0.01
            if server_round > 0.5 * self.run.num_rounds:
                return 0.1
        return 1.0

    def evaluates(self, server_round: int, last: int) -> bool:
        """Whether clients are evaluated in ``server_round`` of a run whose last round
        is ``last`` (``evaluate-every``; the final rounds always are)."""
        if server_round == last:
            return True
        if self.run.evaluate_every == 0:
            return False
        return (
            server_round % self.run.evaluate_every == 0
            or server_round > last - self.run.final_rounds
        )

    # ------------------------------------------------------------ round settings
    def step_size(self) -> float:
        """The clients' step size before the schedule (``lr``; the linear strategies
        override it with their own setting)."""
        return self.run.lr

    def train_config(self) -> ConfigRecord:
        """What the server may change per round travels in the message: the epochs and
        the learning rate (scaled by the schedule in ``train_contents``; the round
        number is added there too). Every other setting the clients read from their own
        typed run configuration."""
        run = self.run
        return ConfigRecord(
            {
                protocol.EPOCHS: run.epochs,
                protocol.HEAD_EPOCHS: run.head_epochs,
                protocol.LR: self.step_size(),
                protocol.RUN_TOKEN: self.run_token,
            }
        )

    def evaluate_config(self) -> ConfigRecord:
        """Evaluation fine-tunes nothing, except in a final test that says so (then
        with the run's learning rate)."""
        return ConfigRecord(
            {
                protocol.FINETUNE_EPOCHS: 0,
                protocol.LR: self.run.lr,
                protocol.RUN_TOKEN: self.run_token,
            }
        )

    # ------------------------------------------------------------------ hooks
    def train_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> dict[int, RecordDict]:
        """What each partition sampled in ``server_round`` receives: the shared arrays
        and the round's settings (the learning rate under the schedule)."""
        self.round_config(server_round, config)
        self.sent_arrays = screening.array_specs(arrays)
        self.current_shared = {name: records.values(array) for name, array in arrays.items()}
        content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: config})
        contents = dict.fromkeys(self.sample(server_round), content)
        if self.flower_step is not None:
            self.flower_step.configure(server_round, arrays, config, list(contents))
        return contents

    def round_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """``config`` with the round number and the learning rate under the schedule
        (in place, and returned)."""
        config[protocol.ROUND] = server_round
        if protocol.LR in config:
            base_lr = records.number(config[protocol.LR], protocol.LR)
            config[protocol.LR] = base_lr * self.lr_factor(server_round)
        return config

    def evaluate_contents(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> dict[int, RecordDict]:
        """EVALUATE to every seen partition (none when the run is evaluated on the
        server)."""
        if not self.evaluate_nodes:
            return {}
        config[protocol.ROUND] = server_round
        content = RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: config})
        return dict.fromkeys(self.seen, content)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The shared arrays of the replies, aggregated by the run's ``aggregation`` (the
        default: ``fedpers.aggregation.weighted_mean``, weighted by ``num-examples``);
        None without a reply that carries weight. The loop passes only the replies that
        passed ``screen``. A private run (``dp``) releases the noised mean of the clipped
        updates instead (``fedpers.privacy.release``), every round, even of no reply."""
        valid = [r for r in replies if screening.num_examples(r) > 0]
        private = self.privacy is not None and bool(self.shared)
        if not valid and not private:
            return None, None
        contents = [reply.content for reply in valid]
        metrics = mean_metrics(contents)
        if not self.shared:
            return None, metrics
        arrays = [screening.arrays_of(reply) for reply in valid]
        if self.private is not None:
            averaged = self.private.release(arrays, self.current_shared, len(self.sampled))
        elif self.flower_step is not None:
            averaged = self.flower_step.aggregate(server_round, valid, self.current_shared)
        else:
            weights = [screening.num_examples(reply) for reply in valid]
            averaged = self.combine(arrays, weights, self.current_shared)
        record = ArrayRecord({k: Array(records.contiguous(v)) for k, v in averaged.items()})
        return record, metrics

    def server_state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps of the server beyond the global arrays: a private
        run's audit canaries (``PrivateRelease.state``), if any."""
        return self.private.state() if self.private is not None else {}

    def restore_server_state(
        self, state: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray], where: Path
    ) -> None:
        """Continue from a checkpoint's ``server_state`` (its global ``arrays`` beside
        it, in the file ``where``; ``PrivateRelease.restore``).

        Raises
        ------
        ResumeError
            If the state is not what this run keeps: an audit's over the checkpoint's
            shared arrays, and none in a run without DP.
        """
        if self.private is not None:
            self.private.restore(state, arrays, where)
        elif audit_state(state):
            raise ResumeError(
                f"{where}: the checkpoint holds a private run's audit canaries, and this "
                "run has dp = 'none'; resume with the run's own settings, or start "
                "afresh (resume = false)"
            )

    def resume_after(self, records: Sequence[RoundRecord]) -> None:
        """Continue a resumed run from ``records`` (its rounds up to its checkpoint's):
        a private run at the clip the last of them chose (``PrivateRelease``)."""
        if self.private is not None:
            self.private.resume_after(records)

    def trims_every_reply(self, replies: int) -> bool:
        """Whether the run's trimmed mean would cut all of ``replies`` (never under the
        other aggregations): for a group whose size is known only during the run (a
        cluster, a class), which then keeps what it had."""
        return self.run.aggregation == Aggregation.TRIMMED_MEAN and trims_all(
            replies, self.run.aggregation_trim
        )

    def combine(
        self,
        arrays: list[dict[str, np.ndarray]],
        weights: list[float],
        reference: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """The run's ``aggregation`` of clients' arrays (``reference``: the current global
        values, from which clipped updates are measured)."""
        return aggregate(
            self.run.aggregation,
            arrays,
            weights,
            reference=reference,
            trim=self.run.aggregation_trim,
            clip=self.run.aggregation_clip,
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Metrics of the replies that pass ``defect`` and ``weight_defect``, weighted by
        ``num-examples``."""
        checks = [screening.defect, screening.weight_defect]
        screened = screening.screen(replies, checks, self.federation.partition)
        return mean_metrics([r.content for r in screened.kept])

    def state_defect(self, new: ArrayRecord, previous: ArrayRecord) -> str | None:
        """Why a new global state must not be adopted, or None: its arrays must be
        those of the previous state (names, shapes, dtypes) and finite."""
        if len(previous) and screening.array_specs(new) != screening.array_specs(previous):
            return "its arrays differ from the previous global state's"
        for name, array in new.items():
            try:
                screening.decode(name, array)
            except screening.ScreeningError as error:
                return str(error)
        return None

    def final_test(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        *,
        server_round: int,
        timeout: float,
    ) -> FinalTestResult | None:
        """The test after the last round: fine-tuned heads (``final_test`` of the row),
        or the unseen clients after adapting; None for neither."""
        if self.spec.final_test in (FinalTest.FINETUNE, FinalTest.FINETUNE_ALL):
            return final_tests.finetuned(
                self, grid, arrays, config, server_round, timeout, epochs=self.run.finetune_epochs
            )
        if self.unseen:
            return final_tests.unseen(
                self,
                grid,
                arrays,
                config,
                server_round,
                timeout,
                partitions=self.unseen,
                adapt_fraction=self.run.adapt_fraction,
            )
        return None

    def round_metrics(self, server_round: int) -> dict[str, float]:
        """Server-side figures of a round for ``rounds.jsonl``: in a private run the
        epsilon spent so far (``dp.epsilon``, at ``dp-delta``) and the releases it
        counts; none otherwise."""
        return self.private.round_metrics() if self.private is not None else {}

    # ------------------------------------------------------------------ screening
    def checks(self) -> list[screening.Check]:
        """The checks a training reply must pass, in order (an algorithm may add); under
        ``dp = "distributed"`` also ``noise_check``."""
        checks: list[screening.Check] = [
            screening.defect, screening.weight_defect, self.arrays_check, self.size_check
        ]  # fmt: skip
        mechanism = self.privacy
        if mechanism is not None and mechanism.mode is privacy.DpMode.DISTRIBUTED:
            checks.append(self.noise_check)
        return checks

    def noise_check(self, reply: Message) -> str | None:
        """Distributed DP: a reply whose update of the shared parts is not what an
        honest device sends, its update clipped and its share of the noise added
        (``privacy.distributed_band``), is left out, so the server tops its share up.
        The decision reads this reply alone, so no client changes what another
        contributes."""
        assert self.private is not None  # only a distributed run checks its noise
        return self.private.noise_defect(screening.arrays_of(reply), self.sent_to(reply))

    def expected_arrays(self) -> dict[str, screening.ArraySpec]:
        """The arrays a training reply must carry: exactly the shared ones sent."""
        return dict(self.sent_arrays) if self.shared else {}

    def arrays_check(self, reply: Message) -> str | None:
        """``screening.arrays_defect`` against ``expected_arrays``."""
        returned = reply.content.array_records.get(protocol.ARRAYS, ArrayRecord())
        return screening.arrays_defect(returned, self.expected_arrays())

    def size_check(self, reply: Message) -> str | None:
        """``screening.magnitude_defect`` against the arrays sent this round."""
        return screening.magnitude_defect(screening.arrays_of(reply), self.sent_to(reply))

    def sent_to(self, reply: Message) -> dict[str, np.ndarray]:
        """The shared arrays that the node of ``reply`` was sent this round, from which
        its update is measured: the same for every node here (Clustered FL sends each
        cluster its own)."""
        return self.current_shared

    def screen(self, server_round: int, replies: Iterable[Message]) -> screening.Screened:
        """Training replies fit to aggregate (``kept``), and the others with why: the
        loop's step between the exchange and ``aggregate_train``.

        No reply weighs more than ``Federation.weight_bounds`` allows: what its node
        registered, and ``weight-cap`` times the lower median of all registered sizes.
        A capped reply is scaled as a whole (``scaled_arrays``) and noted. Replies of
        weight zero are kept but do not count as usable (``min-replies``). Then no
        update may be more than ``update-cap`` times the round's typical one
        (``update_bounded``).
        """
        screened = screening.screen(replies, self.checks(), self.federation.partition)
        return self.update_bounded(self.bounded(screened, test=False))

    def screen_evaluate(self, server_round: int, replies: Iterable[Message]) -> screening.Screened:
        """Evaluation replies fit to aggregate, and the others with why: every reply
        passes ``defect`` and ``weight_defect`` before anything reads it, and weighs at
        most ``Federation.weight_bounds`` of the test sizes."""
        checks = [screening.defect, screening.weight_defect]
        screened = screening.screen(replies, checks, self.federation.partition)
        return self.bounded(screened, test=True)

    def bounded(self, screened: screening.Screened, *, test: bool) -> screening.Screened:
        """``screened`` with every kept reply's ``num-examples`` capped at its bound, the
        arrays that scale with it (``scaled_arrays``) scaled alike, and a note of each."""
        partitions = [self.federation.partition(reply) for reply in screened.kept]
        bounds = self.federation.weight_bounds(partitions, test=test)
        notes = list(screened.notes)
        for partition, reply in zip(partitions, screened.kept, strict=True):
            claimed = screening.num_examples(reply)
            if not claimed > bounds[partition]:
                continue
            held = bounds[partition]
            reply.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES] = float(held)
            self.scale_arrays(reply, held / claimed)
            notes.append((partition, f"num-examples {claimed!r} capped at {_count(held)}"))
        return screening.Screened(screened.kept, screened.rejected, notes)

    def update_bounded(self, screened: screening.Screened) -> screening.Screened:
        """``screened`` less the replies whose update is far larger than the round's:
        each kept reply of positive weight has an update norm (``screening.update_norm``:
        its shared arrays less those sent, as one vector); a norm beyond ``update-cap``
        times the lower median of them all is left out, with the reason. The lower
        median moves at most one rank for one reply, so no one reply sets the bound.

        A private run (``dp``) skips it: whether a reply is kept would then depend on
        the other clients' updates, so adding or removing one client could change what
        others contribute, beyond the sensitivity of one clip the accountant assumes.
        Its clip bounds every reply's influence already.
        """
        counted = [r for r in screened.kept if screening.num_examples(r) > 0]
        if not self.current_shared or len(counted) < 2 or self.privacy is not None:
            return screened
        norms = [self.update_norm(reply) for reply in counted]
        bound, beyond = screening.norm_outliers(norms, self.run.update_cap)
        if not beyond:
            return screened
        typical = bound / self.run.update_cap
        reasons = {
            counted[i]: f"update norm {norms[i]:.3g} beyond update-cap {self.run.update_cap:g} "
            f"x the round's lower-median update norm {typical:.3g}"
            for i in beyond
        }
        return self.left_out(screened, reasons)

    def update_norm(self, reply: Message) -> float:
        """A reply's update norm for ``update_bounded``: its shared arrays less those
        sent to it, as one vector (a row may leave out arrays checked exactly
        elsewhere, whose scale would hide the others')."""
        return screening.update_norm(screening.arrays_of(reply), self.sent_to(reply))

    def left_out(
        self, screened: screening.Screened, reasons: dict[Message, str]
    ) -> screening.Screened:
        """``screened`` with the kept replies of ``reasons`` moved to its rejected ones,
        each with its reason, in the order given."""
        rejected = [*screened.rejected]
        rejected += [(self.federation.partition(r), reason) for r, reason in reasons.items()]
        kept = [r for r in screened.kept if r not in reasons]
        return screening.Screened(kept, rejected, list(screened.notes))

    def scaled_arrays(self) -> tuple[str, ...]:
        """Arrays of a training reply that are sums over its samples (FedEM's
        responsibilities, FedGMM's statistics): scaled with a capped weight."""
        return ()

    def scale_arrays(self, reply: Message, factor: float) -> None:
        """Scale the ``scaled_arrays`` of ``reply`` by ``factor`` (in place)."""
        arrays = reply.content.array_records.get(protocol.ARRAYS)
        if arrays is None:
            return
        for name in self.scaled_arrays():
            if name in arrays:
                values = arrays[name].numpy()
                arrays[name] = Array(records.contiguous(values * factor).astype(values.dtype))

    def configure_train_rejections(self, server_round: int) -> tuple[str, ...]:
        """Answers left out while configuring training, with why: none here; a strategy
        whose ``configure_train`` exchanges messages first (the peer relay) reports its
        own."""
        return ()

    # ---------------------------------------------------------- Flower's interface
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's first step of a round: a TRAIN message to the node of each partition
        ``train_contents`` names (the seeded ``sample`` by default), with its content."""
        contents = self.train_contents(server_round, arrays, config, grid)
        return self.federation.messages(MessageType.TRAIN, contents)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Flower's evaluation step: an EVALUATE message to the node of each partition
        ``evaluate_contents`` names (called in the rounds ``evaluates`` names)."""
        contents = self.evaluate_contents(server_round, arrays, config)
        return self.federation.messages(MessageType.EVALUATE, contents)

    def summary(self) -> None:
        """Log the strategy's configuration."""
        logger.info(
            "%s (%s): %d nodes (%d unseen), fraction-train %.0f%% (round 1 trains %d), "
            "shared %s, seed %d",
            type(self).__name__,
            self.spec.name,
            self.run.num_clients,
            len(self.unseen),
            100 * self.run.fraction_train,
            self.clients_to_train(1),
            list(self.shared) or "none",
            self.run.seed,
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        first_round: int = 1,
        on_round: Callable[[RoundRecord], None] | None = None,
        on_checkpoint: Callable[[int, ArrayRecord], None] | None = None,
    ) -> Result:
        """Flower's loop (``strategies.rounds.run_rounds``): every round
        ``configure_train``, ``aggregate_train``, ``configure_evaluate`` and
        ``aggregate_evaluate``. ``train_config`` and ``evaluate_config`` default to the
        strategy's own (``train_config()``, ``evaluate_config()``). A resumed private
        run counts at least every round before ``first_round`` as released (the
        ServerApp sets the count it made, ``releases.json``, which a round that failed
        or was cut short after its release makes larger)."""
        self.summary()
        if self.private is not None and self.shared:
            self.private.releases = max(self.private.releases, first_round - 1)
        return run_rounds(
            self,
            grid,
            self.federation,
            initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=self.train_config() if train_config is None else train_config,
            evaluate_config=(
                self.evaluate_config() if evaluate_config is None else evaluate_config
            ),
            min_replies=self.run.min_replies,
            evaluate_fn=evaluate_fn,
            first_round=first_round,
            on_round=on_round,
            on_checkpoint=on_checkpoint,
        )


def step_toward(
    reference: dict[str, np.ndarray], target: dict[str, np.ndarray], step: Callable[[str], float]
) -> dict[str, np.ndarray]:
    """``x + step(name) (target - x)`` for every array ``x`` of ``reference`` (in float64,
    returned in its dtype): the server steps of SCAFFOLD, L2GD and pFedMe."""
    moved = {}
    for name, current in reference.items():
        start = current.astype(np.float64)
        moved[name] = (start + step(name) * (target[name] - start)).astype(current.dtype)
    return moved


def _count(value: float) -> str:
    """A sample count as a note shows it: whole numbers without a fraction."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def mean_metrics(contents: list[RecordDict]) -> MetricRecord | None:
    """Flower's weighted mean of the replies' metrics (by ``num-examples``); None when
    there is nothing to weigh."""
    weights = [
        records.number(c.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES]) for c in contents
    ]
    if not contents or not sum(weights) > 0:
        return None
    return aggregate_metricrecords(contents, protocol.NUM_EXAMPLES)
