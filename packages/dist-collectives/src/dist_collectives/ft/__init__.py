"""Reconfigurable, fault-tolerant process groups in the style of torchft.

Every group here is a :class:`torch.distributed.ProcessGroup` that can be moved to other
members: by torchft 0.3's handles (``get_reconfigure_handle``, ``reconfigure``,
:func:`reconfigure_with_store`) or by torchft 0.2's ``configure`` on a new
``host:port/prefix`` of a store that runs in the job.
A :class:`Manager` forms a quorum of live replicas through that store, heals replicas
that join, and decides per step whether it may be committed.
"""

from dist_collectives.ft.coordination.bounded_store import StoreTimeoutError
from dist_collectives.ft.coordination.quorum import Quorum, QuorumTimeoutError
from dist_collectives.ft.coordination.store import (
    RendezvousTimeoutError,
    StoreAddressError,
    create_store_client,
)
from dist_collectives.ft.errors import FTError, UnsupportedOperationError, WorkTimeoutError
from dist_collectives.ft.groups.baby import (
    BabyClosedError,
    BabyProcessError,
    BabyTimeoutError,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)
from dist_collectives.ft.groups.device_mesh import extend_device_mesh
from dist_collectives.ft.groups.dummy import ProcessGroupDummy
from dist_collectives.ft.groups.gloo import ProcessGroupGloo
from dist_collectives.ft.groups.nccl import ProcessGroupNCCL
from dist_collectives.ft.groups.process_group import ProcessGroup, StoreAddressReusedError
from dist_collectives.ft.groups.reconfigurable import ProcessGroupReconfigurableGloo
from dist_collectives.ft.groups.reconfigure import (
    HandleExchangeTimeoutError,
    ReconfigureOptions,
    reconfigure_with_store,
)
from dist_collectives.ft.groups.work import DummyWork, FutureWork, WorkFuture
from dist_collectives.ft.groups.wrappers import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupWrapper,
)
from dist_collectives.ft.replica.ddp import (
    DistributedDataParallel,
    ReplicaAveraging,
    ft_allreduce_hook,
)
from dist_collectives.ft.replica.managed import ManagedProcessGroup
from dist_collectives.ft.replica.manager import Manager, ManagerConfigError, ReplicaError
from dist_collectives.ft.replica.quorum_worker import QuorumWorkerTimeoutError
from dist_collectives.ft.replica.state_transfer import StateTransferError

__all__ = [
    "ProcessGroup",
    "ReconfigureOptions",
    "reconfigure_with_store",
    "ProcessGroupWrapper",
    "ProcessGroupGloo",
    "ProcessGroupReconfigurableGloo",
    "ProcessGroupNCCL",
    "ErrorSwallowingProcessGroupWrapper",
    "ProcessGroupDummy",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "BabyProcessError",
    "BabyClosedError",
    "BabyTimeoutError",
    "Manager",
    "ManagedProcessGroup",
    "DistributedDataParallel",
    "ft_allreduce_hook",
    "ReplicaAveraging",
    "extend_device_mesh",
    "Quorum",
    "DummyWork",
    "FutureWork",
    "WorkFuture",
    "create_store_client",
    "StoreAddressError",
    "StoreAddressReusedError",
    "RendezvousTimeoutError",
    "HandleExchangeTimeoutError",
    "ManagerConfigError",
    "ReplicaError",
    "QuorumTimeoutError",
    "QuorumWorkerTimeoutError",
    "StoreTimeoutError",
    "StateTransferError",
    "FTError",
    "UnsupportedOperationError",
    "WorkTimeoutError",
]
