"""The algorithm table: every algorithm a run can name, one row each.

A row (``AlgorithmSpec``) says what the algorithm shares with the server, how its
clients train locally, which settings it reads, and which strategy and client classes
run it. Classes are named as ``"module:Class"`` and imported only when a run needs them,
so ``fedpers`` imports neither ``strategies`` nor ``clients`` (a device never loads
server code, a server never loads torch).

An algorithm that differs from another only in what it shares or trains is a row and
nothing else (FedPer, LG-FedAvg and FedBABU against FedRep). One that needs more names
its own strategy and/or client class. Users add their own from their own package with
``register``, without editing fedpers::

    from fedpers.algorithms import AlgorithmSpec, Family, register
    register(AlgorithmSpec(name="my-fedper", family=Family.PERSONALIZED, shared=("body",)))

For the ServerApp and every ClientApp process to know it, the package declares a
function that registers its algorithms (and data sets, ``fedpers.data.sources.
register_dataset``, and models, ``fedpers.models.register_model``) in the entry-point
group ``fedpers.extensions``; ``load_extensions`` calls each once per process, before
any run configuration is parsed (see examples/server_momentum).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from enum import StrEnum
from importlib.metadata import entry_points
from typing import Any

from fedpers import families
from fedpers.families.linear import NAME as LINEAR_FAMILY
from fedpers.families.personalized import (
    APFLSettings,
    ClusteredFLSettings,
    DittoSettings,
    FedMTLSettings,
    FedProxSettings,
    L2GDSettings,
    PerFedAvgSettings,
    PFedMeSettings,
    ScaffoldSettings,
)
from fedpers.families.sheaf import (
    ComFedSettings,
    FedMuscleSettings,
    FedProtoSettings,
    SheafFMTLSettings,
)
from fedpers.protocol import BODY, EPOCHS, HEAD, HEAD_EPOCHS, MODEL_PARTS

ENTRY_POINT_GROUP = "fedpers.extensions"


class Family(StrEnum):
    """The built-in families (``fedpers.families``); a row names its family by name, so
    a family from another package needs no member here."""

    PERSONALIZED = "personalized"  # a body/head model, part of it averaged by the server
    MIXTURE = "mixture"  # shared learners (and Gaussian components), personal weights
    SHEAF = "sheaf"  # no shared model: pilots relayed between graph neighbours


class FinalTest(StrEnum):
    """What the server asks of every client after the last round."""

    NONE = "none"
    FINETUNE = "finetune"  # fine-tune the head for ``finetune-epochs``, then test


@dataclass(frozen=True)
class Phase:
    """One phase of a client's local update: train ``parts`` for the epochs that the
    server sends under the message config key ``epochs``."""

    parts: tuple[str, ...]
    epochs: str = EPOCHS


JOINT = (Phase(MODEL_PARTS),)


@dataclass(frozen=True)
class LinearVariant:
    """Strategy and client of an algorithm's linear-model variant (FedRep, Section 4)."""

    strategy: str
    client: str


@dataclass(frozen=True)
class AlgorithmSpec:
    """One row of the algorithm table.

    Parameters
    ----------
    name : str
        The value of the run-config key ``algorithm``.
    family : str
        How server and clients talk: the name of a registered family
        (``fedpers.families``; the built-in ones are the members of ``Family``).
    shared : tuple of str
        Model parts (``body``, ``head``) sent to and averaged by the server; the others
        stay on the device in ``context.state``.
    strategy : str (default: the personalized strategy)
        ``"module:Class"`` of the server strategy.
    client : str (default: the personalized client)
        ``"module:Class"`` of the client.
    phases : tuple of Phase (default: body and head jointly for ``epochs``)
        The local update of a personalized client, in order.
    final_test : FinalTest (default: NONE)
        What every client does after the last round.
    settings : tuple of type (default: ())
        Settings groups (``fedpers.settings``) the algorithm declares itself, beyond the
        core's and its family's; read them with ``run.group(Cls)``.
    unseen : bool (default: False)
        Whether it can serve unseen clients (``unseen-fraction > 0``).
    linear : LinearVariant, optional
        Its variant for the linear model (``dataset = "linear"``).
    deep : bool (default: True)
        False for algorithms that exist only for the linear model.
    personal_state : bool, optional
        Whether clients keep state between rounds beyond their personal parts (Ditto's
        personal model); by default, whether the row keeps model parts or is not of
        the personalized family.
    paper : str (default: "")
        Where it comes from.
    """

    name: str
    family: str
    shared: tuple[str, ...]
    strategy: str = "fedpers.strategies.base:FedpersStrategy"
    client: str = "fedpers.clients.base:PersonalizedClient"
    phases: tuple[Phase, ...] = JOINT
    final_test: FinalTest = FinalTest.NONE
    settings: tuple[type, ...] = ()
    unseen: bool = False
    linear: LinearVariant | None = None
    deep: bool = True
    personal_state: bool | None = None
    paper: str = ""

    @property
    def personal(self) -> tuple[str, ...]:
        """Model parts kept on the device."""
        return tuple(part for part in MODEL_PARTS if part not in self.shared)

    @property
    def keeps_state(self) -> bool:
        """Whether clients keep anything between rounds (personal parts, mixture
        weights, a personal model, a whole agent): then an exact resume needs it on
        disk."""
        if self.personal_state is not None:
            return self.personal_state
        return self.family != Family.PERSONALIZED or bool(self.personal)

    def strategy_class(self, *, family: str | None = None) -> Any:
        """The strategy class of a run of ``family`` (its linear variant for the linear
        family's runs; the row's own otherwise)."""
        return load(self._variant(family).strategy if self._varies(family) else self.strategy)

    def client_class(self, *, family: str | None = None) -> Any:
        """The client class of a run of ``family`` (as ``strategy_class``)."""
        return load(self._variant(family).client if self._varies(family) else self.client)

    def _varies(self, family: str | None) -> bool:
        return family == LINEAR_FAMILY and self.family != LINEAR_FAMILY

    def _variant(self, family: str | None) -> LinearVariant:
        if self.linear is None:
            raise KeyError(f"algorithm '{self.name}' has no variant for family '{family}'")
        return self.linear


def load(path: str) -> Any:
    """Import ``"module:Name"`` and return the named object."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"cannot load '{path}' named in the algorithm table: {error}") from error


_LINEAR_FEDREP = LinearVariant(
    "fedpers.strategies.fedrep:FedRepLinear", "fedpers.clients.linear:LinearFedRepClient"
)
_SHEAF_CLIENT = "fedpers.clients.sheaf:SheafClient"
_FEDPROX_CLIENT = "fedpers.clients.fedprox:FedProxClient"
_SCAFFOLD_STRATEGY = "fedpers.strategies.scaffold:Scaffold"
_SCAFFOLD_CLIENT = "fedpers.clients.scaffold:ScaffoldClient"
_MIXTURE = "Marfoq et al., NeurIPS 2021"

_BUILT_IN = (
    AlgorithmSpec(
        name="fedrep",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        phases=(Phase((HEAD,), HEAD_EPOCHS), Phase((BODY,), EPOCHS)),
        linear=_LINEAR_FEDREP,
        paper="Collins et al., ICML 2021",
    ),
    AlgorithmSpec(
        name="fedper",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        paper="Arivazhagan et al., 2019",
    ),
    AlgorithmSpec(
        name="fedavg",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        unseen=True,
        paper="McMahan et al., AISTATS 2017",
    ),
    AlgorithmSpec(
        name="fedavg-ft",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        final_test=FinalTest.FINETUNE,
        paper="FedAvg, then head fine-tuning (FedRep's Table 1)",
    ),
    AlgorithmSpec(
        name="fedavg-plus",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.fedavg_plus:FedAvgPlusClient",
        unseen=True,
        paper="Jiang et al., 2019 (arXiv 1909.12488), as FedEM's code tunes locally",
    ),
    AlgorithmSpec(
        name="fedprox",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client=_FEDPROX_CLIENT,
        settings=(FedProxSettings,),
        unseen=True,
        paper="Li et al., MLSys 2020",
    ),
    AlgorithmSpec(
        name="fedprox-ft",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client=_FEDPROX_CLIENT,
        settings=(FedProxSettings,),
        final_test=FinalTest.FINETUNE,
        paper="FedProx, then head fine-tuning (FedRep's Table 1)",
    ),
    AlgorithmSpec(
        name="scaffold",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy=_SCAFFOLD_STRATEGY,
        client=_SCAFFOLD_CLIENT,
        settings=(ScaffoldSettings,),
        personal_state=True,  # c_i
        paper="Karimireddy et al., ICML 2020",
    ),
    AlgorithmSpec(
        name="scaffold-ft",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy=_SCAFFOLD_STRATEGY,
        client=_SCAFFOLD_CLIENT,
        settings=(ScaffoldSettings,),
        personal_state=True,
        final_test=FinalTest.FINETUNE,
        paper="SCAFFOLD, then head fine-tuning (FedRep's Table 1)",
    ),
    AlgorithmSpec(
        name="lg-fedavg",
        family=Family.PERSONALIZED,
        shared=(HEAD,),
        paper="Liang et al., 2020",
    ),
    AlgorithmSpec(
        name="local",
        family=Family.PERSONALIZED,
        shared=(),
        paper="local training only",
    ),
    AlgorithmSpec(
        name="ditto",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.ditto:DittoClient",
        personal_state=True,
        settings=(DittoSettings,),
        paper="Li et al., ICML 2021",
    ),
    AlgorithmSpec(
        name="apfl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.apfl:APFLClient",
        personal_state=True,  # v and alpha
        settings=(APFLSettings,),
        paper="Deng et al., 2020 (arXiv 2003.13461)",
    ),
    AlgorithmSpec(
        name="l2gd",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.l2gd:L2GD",
        client="fedpers.clients.l2gd:L2GDClient",
        personal_state=True,  # x_i
        settings=(L2GDSettings,),
        paper="Hanzely and Richtarik, 2020 (arXiv 2002.05516)",
    ),
    AlgorithmSpec(
        name="fed-mtl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedmtl:FedMTL",
        client="fedpers.clients.fedmtl:FedMTLClient",
        personal_state=True,  # w_i
        settings=(FedMTLSettings,),
        paper="Smith et al., NeurIPS 2017, as FedRep's Table 1 ran it",
    ),
    AlgorithmSpec(
        name="per-fedavg",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.perfedavg:PerFedAvgClient",
        settings=(PerFedAvgSettings,),
        paper="Fallah et al., NeurIPS 2020 (first-order)",
    ),
    AlgorithmSpec(
        name="per-fedavg-hf",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.perfedavg:PerFedAvgHFClient",
        settings=(PerFedAvgSettings,),
        paper="Fallah et al., NeurIPS 2020 (Hessian-free)",
    ),
    AlgorithmSpec(
        name="pfedme",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.pfedme:PFedMe",
        client="fedpers.clients.pfedme:PFedMeClient",
        personal_state=True,  # theta
        settings=(PFedMeSettings,),
        paper="T Dinh et al., NeurIPS 2020",
    ),
    AlgorithmSpec(
        name="clustered-fl",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.clustered:ClusteredFL",
        settings=(ClusteredFLSettings,),
        paper="Sattler et al., IEEE TNNLS 2020",
    ),
    AlgorithmSpec(
        name="fedbabu",
        family=Family.PERSONALIZED,
        shared=(BODY,),
        phases=(Phase((BODY,)),),
        final_test=FinalTest.FINETUNE,
        paper="Oh et al., ICLR 2022",
    ),
    AlgorithmSpec(
        name="fedsgd",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        linear=LinearVariant(
            "fedpers.strategies.fedsgd:FedSGD", "fedpers.clients.linear:FedSGDClient"
        ),
        deep=False,
        paper="one global linear model (FedRep, Figures 3-4)",
    ),
    AlgorithmSpec(
        name="fedem",
        family=Family.MIXTURE,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedem:FedEM",
        client="fedpers.clients.fedem:FedEMClient",
        unseen=True,
        paper=_MIXTURE,
    ),
    AlgorithmSpec(
        name="fedgmm",
        family=Family.MIXTURE,
        shared=MODEL_PARTS,
        strategy="fedpers.strategies.fedgmm:FedGMM",
        client="fedpers.clients.fedgmm:FedGMMClient",
        unseen=True,
        paper="Wu et al., ICML 2023",
    ),
    AlgorithmSpec(
        name="sheaf-frl",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.peer_relay:PeerRelay",
        client=_SHEAF_CLIENT,
        paper="Sheaf-FRL, 2026",
    ),
    AlgorithmSpec(
        name="fedproto",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.fedproto:FedProto",
        client="fedpers.clients.fedproto:FedProtoClient",
        settings=(FedProtoSettings,),
        paper="Tan et al., AAAI 2022",
    ),
    AlgorithmSpec(
        name="sheaf-fmtl",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.sheaf_fmtl:SheafFMTL",
        client="fedpers.clients.sheaf_fmtl:SheafFMTLClient",
        settings=(SheafFMTLSettings,),
        paper="Ben Issaid et al., 2025",
    ),
    AlgorithmSpec(
        name="fedmuscle",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.fedmuscle:FedMuscle",
        client="fedpers.clients.fedmuscle:FedMuscleClient",
        settings=(FedMuscleSettings,),
        paper="Setayesh et al., ICLR 2026",
    ),
    AlgorithmSpec(
        name="comfed",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.comfed:ComFed",
        client="fedpers.clients.comfed:ComFedClient",
        settings=(ComFedSettings,),
        paper="Badi et al., IEEE WCL 2026",
    ),
    AlgorithmSpec(
        name="non-cooperative",
        family=Family.SHEAF,
        shared=(),
        strategy="fedpers.strategies.peer_relay:NonCooperative",
        client="fedpers.clients.sheaf:NonCooperativeClient",
        paper="Sheaf-FRL's lambda = 0 baseline, aligned after training",
    ),
)

_TABLE: dict[str, AlgorithmSpec] = {spec.name: spec for spec in _BUILT_IN}


def register(spec: AlgorithmSpec, *, replace: bool = False) -> AlgorithmSpec:
    """Add ``spec`` to the table (from a user's package; nothing in fedpers changes).

    Raises
    ------
    ValueError
        If an algorithm of that name exists and ``replace`` is False, or if the row
        names a model part other than ``body``/``head``.
    """
    if _TABLE.get(spec.name) == spec:  # the same row again (an extension loaded twice)
        return spec
    if spec.name in _TABLE and not replace:
        raise ValueError(
            f"algorithm '{spec.name}' is already registered; choose another name or pass "
            "replace=True"
        )
    unknown = sorted(set(spec.shared) | {p for phase in spec.phases for p in phase.parts})
    unknown = [p for p in unknown if p not in MODEL_PARTS]
    if unknown:
        raise ValueError(
            f"algorithm '{spec.name}' names model part(s) {unknown}; parts are {MODEL_PARTS}"
        )
    try:
        families.get(spec.family)
    except KeyError as error:
        raise ValueError(f"algorithm '{spec.name}': {error.args[0]}") from None
    _TABLE[spec.name] = spec
    return spec


@functools.cache
def load_extensions() -> None:
    """Call, once per process, every function that installed packages declare in the
    entry-point group ``fedpers.extensions`` (each registers algorithms, data sets or
    models)."""
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        entry.load()()


def get(name: str) -> AlgorithmSpec:
    """The row of ``name``.

    Raises
    ------
    KeyError
        With the known names, if ``name`` is not in the table.
    """
    load_extensions()
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(
            f"unknown algorithm '{name}'; choose one of: {', '.join(names())}, or register "
            "your own with fedpers.algorithms.register"
        ) from None


def names() -> list[str]:
    """Every registered algorithm name, built-in ones first."""
    load_extensions()
    return list(_TABLE)


def all_specs() -> list[AlgorithmSpec]:
    """Every registered row."""
    load_extensions()
    return list(_TABLE.values())


def all_groups() -> list[type]:
    """Every settings group the registered rows declare, each once, in table order."""
    return list(dict.fromkeys(group for spec in _TABLE.values() for group in spec.settings))
