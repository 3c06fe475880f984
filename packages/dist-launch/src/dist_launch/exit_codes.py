"""The launcher's exit codes: one per class of ending, for schedulers to act on.

Kubernetes pod failure policies and JobSet's failure policy match a container's exit
code to decide "restart", "ignore" or "fail the job"; a SLURM requeue script reads
the job's. Each class of ending has its own code, written also into ``error.json``
(``extraInfo.exit_code`` and ``extraInfo.exit_class``):

==================  ====  ======================================  ==========================
class               code  what happened                            what a scheduler does
==================  ====  ======================================  ==========================
``SUCCESS``         0     every rank exited 0                      done
``FAILED``          1     a rank's own error: an exception before  fail the job: a retry as
                          the process group existed (ImportError,  is fails again
                          SyntaxError, ...), the same error at
                          the same place after a restart, or any
                          error once the restarts are spent
``USAGE``           2     the command line cannot run as given     fail the job
``HUNG``            75    no rank made progress (--hang-timeout)   retry (EX_TEMPFAIL), or
                          and no restart was left                  fail after a few
``TIMEOUT``         124   ``--timeout`` expired                    fail, or retry longer
``INTERRUPTED``     130   SIGINT: a person stopped it              nothing
``INFRASTRUCTURE``  137   a rank killed by a signal (an OOM kill,  retry, counted
                          SIGKILL, SIGSEGV), the rendezvous or
                          its store lost, the workers could not
                          start
``PREEMPTED``       143   stopped from outside (SIGTERM, SIGHUP):  retry, not counted
                          a scheduler's preemption, a time limit,
                          ``scancel``, a pod's eviction
==================  ====  ======================================  ==========================

Both retryable classes are 128 or above, as Kubeflow's ``restartPolicy: ExitCode``
reads codes (1-127 permanent, 128 and above retryable); 137 is what Kubernetes shows
for a container killed by the OOM killer, 143 for one stopped by SIGTERM.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """The exit code of each class of ending (the table in the module docstring)."""

    SUCCESS = 0
    FAILED = 1
    USAGE = 2
    HUNG = 75
    TIMEOUT = 124
    INTERRUPTED = 130
    INFRASTRUCTURE = 137
    PREEMPTED = 143
