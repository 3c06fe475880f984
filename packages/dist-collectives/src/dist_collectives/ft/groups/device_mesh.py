"""Adding a reconfigurable replica dimension to a torch DeviceMesh."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dist_collectives.ft.groups.process_group import ProcessGroup


def extend_device_mesh(
    mesh: DeviceMesh, pg: ProcessGroup, name: str = "dp", dim: int = 0
) -> DeviceMesh:
    """A mesh with ``pg`` inserted as dimension ``dim`` (of size 1) named ``name``.

    The replica group changes size as replicas come and go, which a DeviceMesh cannot
    express, so the new dimension has size 1 in the mesh while ``pg`` itself spans the
    live replicas, as in torchft. ``pg`` must be registered (:meth:`ProcessGroup.register`)
    so that torch can find it by name.

    Raises:
        ValueError: ``dim`` is out of range, ``name`` is already a dimension, or ``pg``
            is not registered.
    """
    groups = mesh.get_all_groups()
    if not 0 <= dim <= len(groups):
        raise ValueError(f"dim={dim} is out of range for a mesh of {len(groups)} dimensions")
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(len(groups))])
    if name in names:
        raise ValueError(f"the mesh already has a dimension named {name!r}: {names}")
    if pg._registered_name is None:
        raise ValueError(f"{pg!r} is not registered; call pg.register(name) first")
    groups.insert(dim, pg)
    names.insert(dim, name)
    layout = torch.as_tensor(mesh.mesh).unsqueeze(dim)
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=layout, mesh_dim_names=tuple(names))
