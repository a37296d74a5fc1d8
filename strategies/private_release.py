"""The server's part of a private run (``dp``), one part a strategy is built from.

A strategy whose run has a DP mechanism (``fedpers.privacy.run_mechanism``) holds one
``PrivateRelease`` (``FedpersStrategy.private``) and hands it the round's shared arrays;
the part owns everything the guarantee rests on between rounds:

- each round's release, the noised mean of the clipped updates
  (``fedpers.privacy.release``), and the count of releases the accountant charges
  (``releases``; ``on_release`` makes each durable before it leaves the server);
- adaptive clipping: the clip of the next release from this round's update norms;
- the audit's canaries (``dp-audit-canaries``, ``fedpers.audit``): planted at the first
  release, scored at each, kept in the checkpoint (``state``, ``restore``);
- under ``dp = "distributed"`` the per-reply check that a device clipped its update and
  added its share of the noise (``noise_defect``);
- the round's figures for ``rounds.jsonl`` (``round_metrics``) and a resume's clip
  (``resume_after``).

None of it reads another strategy hook: a strategy's server step never sees a private
run's replies (``FedpersStrategy.aggregate_train`` releases instead of combining).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpers import privacy
from fedpers.checkpoint import ResumeError
from fedpers.results import RoundRecord

if TYPE_CHECKING:
    from fedpers.audit import CanaryAudit

Arrays = dict[str, np.ndarray]


class PrivateRelease:
    """The releases, clip and canaries of one private run (``mechanism``)."""

    AUDIT = "audit."  # the audit's state among a checkpoint's server state

    def __init__(self, mechanism: privacy.Mechanism) -> None:
        self.mechanism = mechanism
        self.releases = 0  # rounds whose noised shared parts were released
        # called with the new count before each release leaves the server (the recorder
        # makes it durable: a resume continues from it)
        self.on_release: Callable[[int], None] | None = None
        self.audit: CanaryAudit | None = None  # dp-audit-canaries: planted at the first release
        # adaptive clipping: the clip of the next release, and of the last one
        self.clip = mechanism.clip
        self.applied_clip = self.clip

    def release(self, arrays: list[Arrays], reference: Arrays, sampled: int) -> Arrays:
        """The round's release (``fedpers.privacy.release``) of the replies' ``arrays``
        around the shared arrays sent, ``reference``, at the current clip; under
        adaptive clipping also the next round's clip, from the updates' norms before
        clipping (``fedpers.privacy.adapted_clip``; ``sampled`` clients were asked, the
        missing ones count as unclipped)."""
        mechanism = dataclasses.replace(self.mechanism, clip=self.clip)
        generator = privacy.secret_generator()
        averaged = privacy.release(arrays, reference, mechanism, generator)
        if mechanism.audit_canaries:
            averaged = self.with_canaries(averaged, reference, mechanism, generator)
        self.releases += 1
        if self.on_release is not None:
            self.on_release(self.releases)
        self.applied_clip = self.clip
        if mechanism.adaptive:
            norms = [privacy.update_norm({n: a[n] for n in reference}, reference) for a in arrays]
            missing = max(0, sampled - len(arrays))
            self.clip = privacy.adapted_clip(norms, missing, mechanism, generator)
        return averaged

    def with_canaries(
        self,
        averaged: Arrays,
        reference: Arrays,
        mechanism: privacy.Mechanism,
        generator: np.random.Generator,
    ) -> Arrays:
        """The release ``averaged`` with this round's canary updates in its sum (before
        or after the noise is the same distribution), scored as the auditor scores them
        (``fedpers.audit``); the canaries are planted at the first release."""
        from fedpers.audit import CanaryAudit
        from fedpers.records import unflatten

        if self.audit is None:
            self.audit = CanaryAudit.plant(mechanism.audit_canaries, reference, generator)
        flat = self.audit.contribution(mechanism.clip, mechanism.sampling_rate, generator)
        step = mechanism.server_lr / mechanism.cohort
        moved = {
            name: (averaged[name].astype(np.float64) + step * extra).astype(averaged[name].dtype)
            for name, extra in unflatten(flat, reference).items()
        }
        self.audit.observe(reference, moved)
        return moved

    def noise_defect(self, arrays: Arrays, reference: Arrays) -> str | None:
        """Distributed DP: why a reply's ``arrays`` are not what an honest device sends
        from ``reference`` (its update clipped and its share of the noise added,
        ``privacy.distributed_band``), or None. It reads this reply alone, so no client
        changes what another contributes."""
        mechanism = self.mechanism
        norm = privacy.update_norm({n: arrays[n] for n in reference}, reference)
        size = sum(values.size for values in reference.values())
        low, high = privacy.distributed_band(mechanism, size)
        share = f"noise share of standard deviation {mechanism.share_std:.3g}"
        if norm < low:
            return (
                f"update norm {norm:.4g} below {low:.4g}, the least an update with its "
                f"{share} has: the noise was left out"
            )
        if norm > high:
            return (
                f"update norm {norm:.4g} beyond {high:.4g}, the most an update clipped to "
                f"dp-clip = {mechanism.clip:g} with its {share} has: the clip was skipped"
            )
        return None

    def round_metrics(self) -> dict[str, float]:
        """The epsilon spent so far (``dp.epsilon``, at ``dp-delta``) and the releases it
        counts; under adaptive clipping the clip applied and the next one."""
        adaptive = {privacy.CLIP: self.applied_clip, privacy.NEXT_CLIP: self.clip}
        return {
            privacy.EPSILON: self.mechanism.epsilon(self.releases),
            privacy.RELEASES: float(self.releases),
            **(adaptive if self.mechanism.adaptive else {}),
        }

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps of it: the audit's canaries
        (``fedpers.audit.CanaryAudit.state``), if any."""
        if self.audit is None:
            return {}
        return {self.AUDIT + k: v for k, v in self.audit.state().items()}

    def restore(
        self, state: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray], where: Path
    ) -> None:
        """Continue from a checkpoint's ``state`` (its global ``arrays`` beside it, in
        the file ``where``): the audit goes on with its canaries, coins and scores, so
        that it covers the rounds before the resume too.

        Raises
        ------
        ResumeError
            If the state is not an audit's over the checkpoint's shared arrays.
        """
        from fedpers.audit import CanaryAudit

        kept = audit_state(state)
        if not kept:
            return
        names = [str(n) for n in np.atleast_1d(kept.get("names", np.array([])))]
        try:
            reference = {name: arrays[name] for name in names}
            self.audit = CanaryAudit.restore(kept, reference)
        except (KeyError, ValueError) as error:
            raise ResumeError(
                f"{where}: the audit's canaries cannot continue ({error}); restore the "
                "run's own checkpoint, or start afresh (resume = false)"
            ) from None

    def resume_after(self, records: Sequence[RoundRecord]) -> None:
        """Continue a resumed run from ``records`` (its rounds up to its checkpoint's):
        under adaptive clipping, at the clip the last of them chose."""
        if not self.mechanism.adaptive or not records:
            return
        last = records[-1].server.get(privacy.NEXT_CLIP)
        if last is None:
            raise ResumeError(
                f"round {records[-1].round} of rounds.jsonl has no '{privacy.NEXT_CLIP}': "
                "an adaptive clip cannot continue from it; start the run afresh"
            )
        if isinstance(last, bool) or not isinstance(last, int | float) or not 0 < last < math.inf:
            raise ResumeError(
                f"round {records[-1].round} of rounds.jsonl has '{privacy.NEXT_CLIP}' = "
                f"{last!r}, not a clip (a finite number above 0): restore the run's own "
                "rounds.jsonl, or start the run afresh"
            )
        self.clip = self.applied_clip = float(last)


def audit_state(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The audit's part of a checkpoint's server state, its prefix removed."""
    prefix = PrivateRelease.AUDIT
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
