"""Where each setting of a run comes from: one small function per source, one merge.

Each source returns ``{setting: (raw value, source name)}`` for the settings it has;
:meth:`Settings.merge` keeps, for each setting, the first source's value:

1. :func:`flag_settings`: the command line (either spelling of each flag);
2. :func:`pet_settings`: ``PET_<FLAG>``, as torchrun reads them;
3. :func:`dist_launch.plan.slurm.slurm_settings`: the node settings of a SLURM job step;
4. :func:`dist_launch.plan.kubernetes.kubernetes_settings`: those of a Kubernetes pod;
5. :func:`default_settings`: the documented defaults (torchrun's, except where
   :mod:`dist_launch.plan.build` says otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dist_launch.plan.hang_policy import DEFAULT_HANG_TIMEOUT

# Raw value and where it came from ("flag", "PET_NNODES", "SLURM_NODEID", "default").
Setting = tuple[str, str]
SettingsBySource = dict[str, Setting]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# Parsed values that are not settings of the run.
_NOT_SETTINGS = frozenset({"target", "target_args"})
_FALSE = ("", "0", "false", "False")


def flag_settings(values: Mapping[str, object]) -> SettingsBySource:
    """The settings given on the command line (the parser leaves the others None)."""
    return {
        name: (str(value), "flag")
        for name, value in values.items()
        if value is not None and name not in _NOT_SETTINGS
    }


def pet_settings(environ: Mapping[str, str]) -> SettingsBySource:
    """Every non-empty ``PET_<FLAG>`` variable, as the setting ``<flag>``."""
    return {
        variable[4:].lower(): (value, variable)
        for variable, value in environ.items()
        if variable.startswith("PET_") and value
    }


def default_settings() -> SettingsBySource:
    """The defaults of the settings that have one (the others default to None)."""
    defaults = {
        "nnodes": "1",
        "nproc_per_node": "1",
        "rdzv_backend": "static",
        "rdzv_endpoint": "",
        "rdzv_id": "none",
        "rdzv_conf": "",
        "node_rank": "0",
        "master_addr": "127.0.0.1",
        "max_restarts": "0",
        "monitor_interval": "0.1",
        "start_method": "forkserver",
        "event_log_handler": "null",
        "role": "default",
        "redirects": "0",
        "tee": "0",
        "local_ranks_filter": "",
        "duplicate_stdout_filters": "",
        "duplicate_stderr_filters": "",
        "signals_to_handle": DEFAULT_SIGNALS,
        "hang_timeout": DEFAULT_HANG_TIMEOUT,
    }
    return {name: (value, "default") for name, value in defaults.items()}


@dataclass(frozen=True)
class Settings:
    """Each setting's raw value, from the first source that has it.

    Attributes:
        chosen: Setting name -> (raw value, source name).
        defaults: The default of each setting that has one, for an empty given value.
    """

    chosen: Mapping[str, Setting]
    defaults: Mapping[str, str]

    @classmethod
    def merge(cls, *sources: SettingsBySource) -> Settings:
        """The first source's value of each setting (``sources`` in precedence order)."""
        chosen: dict[str, Setting] = {}
        for source in sources:
            for name, setting in source.items():
                chosen.setdefault(name, setting)
        defaults = {
            name: value
            for source in sources
            for name, (value, origin) in source.items()
            if origin == "default"
        }
        return cls(chosen, defaults)

    def get(self, name: str) -> str | None:
        """The raw value (an empty one given as its default); None when no source has it."""
        setting = self.chosen.get(name)
        if setting is None:
            return None
        return setting[0] or self.defaults.get(name, setting[0])

    def text(self, name: str) -> str:
        """:meth:`get`, or ``""`` when no source has the setting."""
        return self.get(name) or ""

    def switch(self, name: str) -> bool:
        """A yes/no setting: true unless absent, empty, ``0`` or ``false``."""
        setting = self.chosen.get(name)
        return setting is not None and setting[0].strip() not in _FALSE

    def source(self, name: str) -> str:
        """Where the setting came from (``"default"`` when no source has it)."""
        setting = self.chosen.get(name)
        return "default" if setting is None else setting[1]

    def sources(self) -> dict[str, str]:
        """Every setting's source, by name."""
        return {name: origin for name, (_, origin) in self.chosen.items()}
