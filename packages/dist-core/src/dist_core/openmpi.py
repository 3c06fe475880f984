"""The master port of a one-host ``mpirun`` job that names none.

Open MPI gives each rank ``OMPI_COMM_WORLD_*`` but no rendezvous address; on one host
the master is this host, and the port must differ between ``mpirun`` jobs running at
once there (a fixed 29500 made the second job's rank 0 fail with ``EADDRINUSE``). It is
derived from the job's own identity, which every rank of the job shares:

- Open MPI 4 (ORTE): ``OMPI_MCA_ess_base_jobid``, the job family (16 bits, a new one
  for each ``mpirun``) shifted left by 16, plus the job's number in its family;
- Open MPI 5 (PRRTE): ``PMIX_NAMESPACE``, a name unique to the ``mpirun``.

Either becomes a port in ``[12000, 32000)``, the range of
:func:`~dist_core.slurm.slurm_master_port`, below Linux's ephemeral range.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from dist_core.errors import DistEnvError
from dist_core.slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN, SLURM_STEP_STRIDE

JOBID_VARIABLE = "OMPI_MCA_ess_base_jobid"
NAMESPACE_VARIABLE = "PMIX_NAMESPACE"


def openmpi_master_port(environ: Mapping[str, str]) -> int | None:
    """The master port of this ``mpirun`` job, from its identity; None when it has none.

    Reads ``OMPI_MCA_ess_base_jobid`` (job family ``J >> 16`` and number ``J & 0xFFFF``:
    ``12000 + (family + 12361 x number) % 20000``, so jobs of one family differ and
    ``mpirun`` jobs collide only when their families differ by a multiple of 20000),
    else ``PMIX_NAMESPACE`` (its CRC-32, modulo 20000).

    Raises:
        DistEnvError: ``OMPI_MCA_ess_base_jobid`` is not a number.
    """
    raw = environ.get(JOBID_VARIABLE, "").strip()
    if raw:
        try:
            jobid = int(raw)
        except ValueError:
            raise DistEnvError(f"{JOBID_VARIABLE}={raw} is not an integer") from None
        family, number = jobid >> 16, jobid & 0xFFFF
        return SLURM_PORT_BASE + (family + SLURM_STEP_STRIDE * number) % SLURM_PORT_SPAN
    namespace = environ.get(NAMESPACE_VARIABLE, "").strip()
    if namespace:
        return SLURM_PORT_BASE + zlib.crc32(namespace.encode()) % SLURM_PORT_SPAN
    return None
