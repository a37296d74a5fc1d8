"""What the server asks the nodes before round 1, one part a strategy is built from.

A strategy holds one ``Startup`` (``FedpersStrategy.startup_part``): it sends a start-up
query to some partitions and keeps the answers that pass screening (``ask``), records
every answer it leaves out and why (``reject``, ``rejections``: the summary's
``startup_rejections``), and chooses the initial model by the nodes' majority
(``initial_model``). A strategy whose start needs more than the initial model (FedRep's
linear statistics, FedGMM's anchor) asks through the same part, so its rejections are
recorded alike.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedpers import privacy, protocol
from fedpers.strategies import screening
from fedpers.strategies.federation import Federation, PopulationError

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class Startup:
    """Start-up queries to the nodes of ``federation`` and the initial model's vote
    among at most ``vote_size`` of them."""

    def __init__(self, federation: Federation, vote_size: int) -> None:
        self.federation = federation
        self.vote_size = vote_size
        self._rejections: list[str] = []

    def initial_model(self, grid: Grid, timeout: float) -> Arrays:
        """The seeded initial model's shared arrays, as a majority of the nodes build it.

        Every process builds the same model from the seed, so the server needs no model
        code (and no torch) to start. The voters (``voters``: every node, or
        ``vote-size`` of them drawn by the server's secret generator) are asked for the
        SHA-256 of what they build (32 bytes, ``protocol.arrays_digest``), and nodes of
        equal digests form a group. From the largest group down, the server fetches one
        member's arrays: a group whose members send none that pass screening and match
        their digest casts no vote. The model is that of the group with more than half
        of the votes cast, so no minority of the voters chooses it (three nodes were
        asked before: two colluders chose the start), and nodes that send a broken model
        cannot block the others. With a drawn sample, a wrong model wins only if the
        sample happens to hold a majority of nodes that send it: a hypergeometric tail
        (docs/architecture.md, invariant 4). In a clean run one group holds every voter
        and one fetch decides.

        Raises
        ------
        PopulationError
            If no group has more than half of the valid votes.
        """
        ask = RecordDict({protocol.CONFIG: ConfigRecord({protocol.DIGEST: 1})})
        digests = self.ask(
            grid, protocol.QUERY_INITIAL, self.voters(), ask, timeout, check=_digest_defect
        )

        groups: dict[bytes, list[int]] = {}
        for partition, answer in sorted(digests.items()):
            groups.setdefault(answer[protocol.DIGEST].tobytes(), []).append(partition)
        pending = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1]))
        unverified, valid = len(digests), 0
        chosen: tuple[list[int], Arrays] | None = None
        for digest, members in pending:
            unverified -= len(members)
            arrays = self._arrays_of_digest(grid, digest, members, timeout)
            if arrays is not None:
                valid += len(members)
                chosen = chosen or (members, arrays)
            if chosen is not None and 2 * len(chosen[0]) > valid + unverified:
                break  # no later group can outvote it, whatever it holds
        if chosen is None or not 2 * len(chosen[0]) > valid + unverified:
            raise PopulationError(
                f"no initial model is built by more than half of the {valid} nodes that "
                "sent a valid one; check that every node runs the same fedpers version and "
                "run config"
            )
        members, arrays = chosen
        for partition in sorted(set(digests) - set(members)):
            self.reject(
                partition, f"{protocol.QUERY_INITIAL}: its initial model is not the majority's"
            )
        return arrays

    def voters(self) -> list[int]:
        """The partitions that vote on the initial model: every one where there are at
        most ``vote-size``, else ``vote-size`` distinct ones drawn by the server's secret
        generator (unknown to the nodes beforehand, so no node can arrange to be asked),
        sorted."""
        everyone = sorted(self.federation.node_of_partition)
        if len(everyone) <= self.vote_size:
            return everyone
        chosen = privacy.secret_generator().choice(everyone, self.vote_size, replace=False)
        return sorted(int(p) for p in chosen)

    def _arrays_of_digest(
        self, grid: Grid, digest: bytes, members: list[int], timeout: float
    ) -> Arrays | None:
        """The arrays of the first of ``members`` (at most three are asked) whose answer
        passes screening and has ``digest``, or None (each member that fails is
        recorded)."""
        for partition in members[:3]:
            try:
                answer = self.ask(grid, protocol.QUERY_INITIAL, [partition], RecordDict(), timeout)
            except PopulationError:
                continue  # recorded as a start-up rejection
            arrays = answer[partition]
            if protocol.arrays_digest(arrays).tobytes() == digest:
                return arrays
            self.reject(partition, f"{protocol.QUERY_INITIAL}: its arrays differ from its digest")
        return None

    def ask(
        self,
        grid: Grid,
        query: str,
        partitions: list[int],
        content: RecordDict,
        timeout: float,
        check: screening.Check | None = None,
    ) -> dict[int, Arrays]:
        """Ask ``partitions`` a start-up ``query``; the decoded arrays of the answers that
        pass ``defect`` and ``check``, by partition. The others are left out and recorded
        (``rejections``).

        Raises
        ------
        PopulationError
            If no answer passes.
        """
        exchange = self.federation.broadcast(grid, query, partitions, content, timeout=timeout)
        checks = [screening.defect] + ([check] if check is not None else [])
        good = {}
        for partition in partitions:
            reply = exchange.replies.get(partition)
            if reply is None:
                reason: str | None = exchange.failures.get(partition, "no reply")
            else:
                reason = screening.first_defect(reply, checks)
            if reason is None and reply is not None:
                good[partition] = screening.arrays_of(reply)
            else:
                self.reject(partition, f"{query}: {reason}")
        if not good:
            raise PopulationError(f"{query}: no node gave a usable answer; {self._rejections[:3]}")
        return good

    def reject(self, partition: int, reason: str) -> None:
        """Record that ``partition``'s answer to a start-up query was left out, and why."""
        logger.warning("round 0: left out the reply of partition %d: %s", partition, reason)
        self._rejections.append(f"partition {partition}: {reason}")

    @property
    def rejections(self) -> tuple[str, ...]:
        """The start-up answers left out, with why (``partition P: query: reason``), in
        the order they came."""
        return tuple(self._rejections)


def _digest_defect(reply: Message) -> str | None:
    """Why a ``query.initial`` digest answer is not one SHA-256 (32 uint8), or None."""
    arrays = screening.arrays_of(reply)
    digest = arrays.get(protocol.DIGEST)
    if set(arrays) != {protocol.DIGEST} or digest is None:
        return (
            f"arrays {sorted(map(screening.shown, arrays))[:3]}, expected only '{protocol.DIGEST}'"
        )
    if digest.shape != (32,) or digest.dtype != np.uint8:
        return f"'{protocol.DIGEST}' is {digest.dtype}{list(digest.shape)}, not uint8[32]"
    return None
