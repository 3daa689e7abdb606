"""Training state and its orbax checkpoints.

Layout (orbax `CheckpointManager`): `<ckpt_dir>/<step>/state` (StandardSave
of the trained params, the optimizer state and the step) and
`<ckpt_dir>/<step>/meta` (JSON: what the state belongs to, such as the base
model's name and parameter fingerprint and the adapter's config, plus the
step). A run resumes from the latest step; `check_meta` refuses a checkpoint
made for another model or adapter.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["TrainState", "fingerprint", "save", "restore", "latest_step", "read_meta",
           "check_meta"]


class TrainState(NamedTuple):
    """step: `[]` int32 optimizer steps done; params: the trained pytree; opt_state: optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


def fingerprint(params) -> str:
    """A cheap, order-sensitive fingerprint of a parameter pytree (hex sha256).

    Hashes every leaf's path, shape, dtype, float64 sum, sum of squares and
    first 8 values: any reload of different weights changes it.
    """
    h = hashlib.sha256()
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(a)
        af = a.astype(np.float64).ravel()
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}|".encode())
        h.update(np.array([af.sum(), np.square(af).sum()]).tobytes())
        h.update(af[:8].tobytes())
    return h.hexdigest()


def _manager(ckpt_dir: str, max_to_keep: int = 3):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save(ckpt_dir: str, state: TrainState, meta: dict) -> int:
    """Save `state` at step `int(state.step)` with the JSON `meta` (and the step);
    returns the step."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    mgr = _manager(ckpt_dir)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                           meta=ocp.args.JsonSave({**meta, "step": step})),
             force=True)
    mgr.wait_until_finished()
    mgr.close()
    return step


def latest_step(ckpt_dir: str) -> int | None:
    """The latest saved step in `ckpt_dir`, or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    mgr = _manager(ckpt_dir)
    step = mgr.latest_step()
    mgr.close()
    return step


def _restore(ckpt_dir: str, step: int | None, **items) -> dict:
    """orbax's restore of `items` (name -> restore args) at `step` (default the latest)."""
    import orbax.checkpoint as ocp

    mgr = _manager(ckpt_dir)
    step = mgr.latest_step() if step is None else step
    if step is None:
        mgr.close()
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    got = mgr.restore(step, args=ocp.args.Composite(**items))
    mgr.close()
    return got


def restore(ckpt_dir: str, target: TrainState, step: int | None = None):
    """Restore a TrainState shaped like `target` (latest step by default).

    Returns:
      (TrainState, meta dict).
    Raises:
      FileNotFoundError: no checkpoint there.
    """
    import orbax.checkpoint as ocp

    tree = target._asdict()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
    got = _restore(ckpt_dir, step, state=ocp.args.StandardRestore(abstract),
                   meta=ocp.args.JsonRestore())
    # Re-impose the target's tree structure (optax NamedTuples come back as tuples).
    leaves = jax.tree_util.tree_leaves(got["state"])
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)
    return TrainState(**state), got["meta"]


def read_meta(ckpt_dir: str, step: int | None = None) -> dict:
    """The JSON meta of a checkpoint (latest step by default), without its arrays.

    Raises:
      FileNotFoundError: no checkpoint there.
    """
    import orbax.checkpoint as ocp

    return _restore(ckpt_dir, step, meta=ocp.args.JsonRestore())["meta"]


def check_meta(ckpt_dir: str, meta: dict, want: dict) -> None:
    """Raises ValueError naming the first key of `want` whose value differs in the
    checkpoint's `meta` (another base model, adapter or config); values are compared
    as JSON stores them (tuples as lists)."""
    want = json.loads(json.dumps(want))
    for key, value in want.items():
        if meta.get(key) != value:
            raise ValueError(f"{ckpt_dir} step {meta.get('step')}: the checkpoint's {key} is "
                             f"{meta.get(key)!r:.120}, this run's is {value!r:.120}")
