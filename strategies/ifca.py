"""IFCA's server step (Ghosh et al., NeurIPS 2020, Algorithm 2, model averaging): each
of the k models becomes the plain mean of the models trained on it this round, a model
no client chose stays. A reply carries the one model its client trained and ``gamma_c``
naming it (``fedpers/algorithms/ifca.py``); completed with the other models as sent,
it is screened and averaged as FedEM's exchange."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Message, RecordDict

from fedpers import protocol, records
from fedpers.families import mixture as mixture_family
from fedpers.strategies import screening
from fedpers.strategies.fedem import FedEM


class IFCA(FedEM):
    """FedEM's strategy with each model weighted 1 by the clients that chose it (the
    column of their ``gamma_c`` that holds their samples), 0 by the others."""

    def screen(self, server_round: int, replies: Iterable[Message]) -> screening.Screened:
        """FedEM's screening of the replies, each first ``completed``."""
        return super().screen(server_round, [self.completed(reply) for reply in replies])

    def completed(self, reply: Message) -> Message:
        """A reply that carries one model, the one its ``gamma_c`` names (or model 0, a
        client without samples), with the other models added as they were sent: what
        a client that trained only that model would send under FedEM's exchange, so
        that the other k - 1 add no update. Any other reply is left as it came, for
        the checks to judge (``arrays_check`` refuses a reply without every model)."""
        if reply.has_error() or protocol.ARRAYS not in reply.content.array_records:
            return reply
        record = reply.content.array_records[protocol.ARRAYS]
        carried = {
            m
            for m in range(self.learners)
            for name in record
            if name.startswith(mixture_family.learner_prefix(m))
        }
        if len(carried) != 1 or mixture_family.GAMMA not in record:
            return reply
        try:
            gamma = records.values(record[mixture_family.GAMMA])
            named = set(np.flatnonzero(gamma.sum(axis=0)).tolist())
        except Exception:  # a gamma that does not decode: the checks say so
            return reply
        if not named <= carried:
            return reply
        prefixes = tuple(mixture_family.learner_prefix(m) for m in range(self.learners))
        for name, array in self.current.items():
            if name not in record and name.startswith(prefixes):
                record[name] = array
        return reply

    def checks(self) -> list[screening.Check]:
        """FedEM's, then IFCA's rule: a client trained one model."""
        return [*super().checks(), self.one_choice_defect]

    def one_choice_defect(self, reply: Message) -> str | None:
        """``gamma_c`` must put all the client's samples on one model (FedEM's check
        already made it non-negative and sum to them)."""
        gamma = screening.arrays_of(reply)[mixture_family.GAMMA]
        chosen = int(np.count_nonzero(gamma.sum(axis=0)))
        if chosen > 1:
            return f"gamma spreads its samples over {chosen} models; IFCA trains one"
        return None

    def learner_weights(self, content: RecordDict) -> np.ndarray:
        """1 for the model the client trained (its ``gamma_c``'s non-zero column), 0
        for the others (M2,)."""
        gamma = content.array_records[protocol.ARRAYS][mixture_family.GAMMA].numpy()
        return (gamma.sum(axis=0) > 0).astype(float)
