"""Named axes, meshes and collectives over the branch axis.

The decode step is written for one branch. The branches of a prompt live on
a named axis: a vmap axis called "branch" on one device; under `shard_map`
the mesh axis "branch" splits them across devices and the vmap axis inside
each device is called "branch_local". Code that must see the other branches
(Bridge layers) gathers over `branch_axes`, innermost first, with
`gather_branches`, so the same code runs on one device and on a mesh.

Multi-host: call `jax.distributed.initialize()` (see `initialize_distributed`)
before building the mesh; the mesh then spans every host's devices and
nothing else changes.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

BRANCH_AXIS = "branch"  # vmap axis of the branches, and mesh axis when sharded
DATA_AXIS = "data"  # mesh axis of the prompts
LOCAL_BRANCH_AXIS = "branch_local"  # vmap axis name when BRANCH_AXIS is a mesh axis


def gather_branches(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """All branches' copies of x, in global branch order.

    Args:
      x: one branch's array `[...]`.
      axes: branch axis names, innermost (vmap) first; () means this branch only.
    Returns:
      `[N, ...]` where N is the product of the axes' sizes (1 for ()).
    """
    if not axes:
        return x[None]
    out = jax.lax.all_gather(x, axes[0])
    for ax in axes[1:]:
        out = jax.lax.all_gather(out, ax, tiled=True)
    return out


def branch_index(axes: Sequence[str]):
    """This branch's global index along `axes` (innermost first); 0 for ()."""
    index, stride = 0, 1
    for ax in axes:
        index = index + jax.lax.axis_index(ax) * stride
        stride = stride * jax.lax.psum(1, ax)
    return index


def make_mesh(branch: int = 1, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ("data", "branch") mesh over `data * branch` devices (default: the first ones).

    Raises:
      ValueError: fewer devices than data * branch, or a size that is not an int >= 1.
    """
    for name, v in (("data", data), ("branch", branch)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"make_mesh: {name} must be an int >= 1, got {v!r}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < branch * data:
        raise ValueError(f"a mesh of data={data} x branch={branch} needs {branch * data} "
                         f"devices, {len(devices)} available")
    grid = np.array(devices[:branch * data]).reshape(data, branch)
    return jax.sharding.Mesh(grid, (DATA_AXIS, BRANCH_AXIS))


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, timeout_s: int = 300) -> None:
    """Multi-host start-up: a thin, documented call of `jax.distributed.initialize`.

    On TPU pods and SLURM/Kubernetes GPU clusters, call with no arguments
    (JAX detects the cluster); elsewhere pass the coordinator's host:port,
    the process count and this process's id. Then build the mesh with
    `make_mesh` over `jax.devices()` (all hosts' devices). The call blocks until
    all processes have joined; after `timeout_s` seconds (JAX's
    `initialization_timeout`) JAX aborts the process (jax 0.10: a fatal error,
    not an exception).
    """
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s)
