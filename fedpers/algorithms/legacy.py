"""Rows not yet written for a cohort: each names a client class that trains one
partition at a time (``AlgorithmSpec.client``). Temporary: each moves to a module of its
own as its update is written for a cohort."""

from __future__ import annotations

from fedpers.algorithms import AlgorithmSpec, Family, LinearVariant
from fedpers.families.personalized import (
    APFLSettings,
    ClusteredFLSettings,
    DittoSettings,
    FedMTLSettings,
    L2GDSettings,
    PerFedAvgSettings,
    PFedMeSettings,
)
from fedpers.families.sheaf import (
    ComFedSettings,
    FedMuscleSettings,
    FedProtoSettings,
    SheafFMTLSettings,
)
from fedpers.protocol import MODEL_PARTS

LINEAR_FEDREP = LinearVariant(
    "fedpers.strategies.fedrep:FedRepLinear", "fedpers.clients.linear:LinearFedRepClient"
)
_SHEAF_CLIENT = "fedpers.clients.sheaf:SheafClient"
_MIXTURE = "Marfoq et al., NeurIPS 2021"

ROWS = (
    AlgorithmSpec(
        name="fedavg-plus",
        family=Family.PERSONALIZED,
        shared=MODEL_PARTS,
        client="fedpers.clients.fedavg_plus:FedAvgPlusClient",
        unseen=True,
        paper="Jiang et al., 2019 (arXiv 1909.12488), as FedEM's code tunes locally",
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
