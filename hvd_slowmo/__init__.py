"""hvd_slowmo: SlowMo (Slow Momentum; Wang, Tantia, Ballas, Rabbat, ICLR 2020, arXiv 1910.00643)
as a drop-in for ``horovod.torch.DistributedOptimizer``.

Glossary (paper symbol -> name in this package):

==================  =========================================================
``m``               number of workers (``communicator.size``)
``tau``             ``tau``: base-algorithm steps per outer step
``alpha``           ``slow_lr``
``beta``            ``slow_momentum``
``gamma_t``         the base optimizer's current ``lr`` (per param group)
``x_{t,0}``         the anchor: parameters at the start of outer step ``t``
``u_t``             the slow (momentum) buffer
``w``               ``ps_weight``: the push-sum weight of gossip bases
==================  =========================================================

Usage::

    import horovod.torch as hvd, hvd_slowmo
    hvd.init()
    opt = hvd_slowmo.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          named_parameters=model.named_parameters(),
                                          base="localsgd", tau=12, slow_lr=1.0, slow_momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""

from .bases import BASES, BaseAlgorithm
from .checkpoint import (
    CheckpointError,
    broadcast_optimizer_state,
    load_checkpoint,
    save_checkpoint,
)
from .comm.hierarchy import Hierarchy
from .compression.sparse import SparseCodec
from .config import SlowMoConfig
from .islands import Islands
from .optimizer import DistributedOptimizer
from .state_format import STATE_FORMAT
from .straggler import Quorum

__all__ = [
    "BASES",
    "STATE_FORMAT",
    "BaseAlgorithm",
    "CheckpointError",
    "DistributedOptimizer",
    "Hierarchy",
    "Islands",
    "Quorum",
    "SlowMoConfig",
    "SparseCodec",
    "broadcast_optimizer_state",
    "load_checkpoint",
    "save_checkpoint",
]
__version__ = "0.1.0"
