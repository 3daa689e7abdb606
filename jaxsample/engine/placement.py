"""Where the engine's arrays live: the serving parameters (placed once per model
and mesh), host <-> global-array copies, the KV bytes a request allocates,
and the shardings and `shard_map` wrappers of the programs on a mesh.
Engine-internal (used by `session.py`)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import jax
import numpy as np

from jaxsample.engine.state import SLOT_FIELDS, DecodeState, Knobs, Outputs, PrefixCache
from jaxsample.lm import LanguageModel
from jaxsample.models.families import families
from jaxsample.sharding import BRANCH_AXIS

_SERVING: "weakref.WeakKeyDictionary[LanguageModel, Any]" = weakref.WeakKeyDictionary()


def serving_params(lm: LanguageModel):
    """The model's parameters in the list layout (one dict per layer), made once per model.

    `jaxsample.load` already returns this layout; stacked parameters (random
    test models) are split once here and cached for the model's lifetime.
    """
    if isinstance(lm.params["layers"], (list, tuple)):
        return lm.params
    if lm not in _SERVING:
        _SERVING[lm] = families.module_for(lm.config).unstack_layers(lm.params)
    return _SERVING[lm]


_ON_MESH: "weakref.WeakKeyDictionary[LanguageModel, dict]" = weakref.WeakKeyDictionary()


def forget(lm: LanguageModel) -> None:
    """Drop the serving layout and the mesh placements made for `lm` (its weights are
    being replaced: `LLM.update_weights`), so they can be freed now."""
    _SERVING.pop(lm, None)
    _ON_MESH.pop(lm, None)


def params_on_mesh(lm: LanguageModel, mesh):
    """The serving params replicated over `mesh`, placed once per (model, mesh).

    Placing them goes through host memory (`place`), so doing it on every
    `generate` call would copy all the weights each time.
    """
    per_mesh = _ON_MESH.setdefault(lm, {})
    if mesh not in per_mesh:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps

        params, rep = serving_params(lm), NamedSharding(mesh, Ps())
        if jax.process_count() == 1:  # device to device; several processes go through the host
            per_mesh[mesh] = jax.device_put(params, rep)
        else:
            per_mesh[mesh] = place(params, rep)
    return per_mesh[mesh]


def place(tree, sharding):
    """Host values -> global arrays on a mesh (works across processes: each
    process passes the same values and provides its own devices' shards)."""

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree_util.tree_map(one, tree)


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def kv_bytes(arrays, rows: int, rows_alloc: int) -> tuple[int, int, int]:
    """(bytes of the request's rows, bytes on one device, bytes on all devices).

    The first counts one copy of each array's real rows (axis 0), without the
    padding rows that fill a data axis; the others are what was allocated:
    one device's shard, and the shards summed over every device (an array
    replicated over the "branch" axis counts once per replica).
    """
    logical = sum(int(a.nbytes) for a in arrays) * rows // max(rows_alloc, 1)
    shard = lambda a: math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    per_device = sum(shard(a) for a in arrays)
    total = sum(len(a.sharding.device_set) * shard(a) for a in arrays)
    return logical, int(per_device), int(total)


class MeshLayout:
    """Shardings and shard_map wrappers of the engine's programs on a mesh."""

    def __init__(self, mesh, data_axis):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps

        self.mesh, self.d = mesh, data_axis
        d, b = data_axis, BRANCH_AXIS
        self.rep = NamedSharding(mesh, Ps())
        self.rows = NamedSharding(mesh, Ps(d))
        self.slots = NamedSharding(mesh, Ps(d, b))
        self.prefix_spec = PrefixCache(Ps(d), Ps(d), Ps(d))
        self.context_spec = Ps()  # the common context: replicated on every device
        # Every slot field over (data, branch), the row fields over data, the clock
        # replicated; the outputs' signals with SamplingParams.signals only (a state
        # whose `signals` is None has no leaf there).
        slot = {f: Ps(d, b) for f in SLOT_FIELDS}
        slot["out"] = Outputs(*([Ps(d, b)] * 5), signals=None)
        self.state_spec = DecodeState(t=Ps(), prompt_index=Ps(d), prompt_mask=Ps(d), **slot)
        self.state_spec_signals = self.state_spec._replace(
            out=slot["out"]._replace(signals=Ps(d, b)))
        # Per-row settings are split over the data axis like the rows; t_stop replicated.
        self.knob_spec = Knobs(*([Ps(d)] * len(Knobs._fields)))._replace(t_stop=Ps())
        self.Ps = Ps
        self.NamedSharding = NamedSharding

    def place_knobs(self, knobs):
        """Host `Knobs` placed as `knob_spec` says (rows over the data axis)."""
        return Knobs(*(place(a, self.NamedSharding(self.mesh, spec))
                       for a, spec in zip(knobs, self.knob_spec)))

    def shard_map(self, fn, in_specs, out_specs):
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:  # older jax
            from jax.experimental.shard_map import shard_map  # type: ignore
        kwargs = dict(mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
        try:
            return shard_map(fn, check_vma=False, **kwargs)
        except TypeError:  # older signature
            return shard_map(fn, check_rep=False, **kwargs)

    def shardings(self, spec_tree, like):
        """NamedShardings for the pytree `like`, following the spec prefix `spec_tree`."""
        is_spec = lambda x: isinstance(x, self.Ps)
        return jax.tree_util.tree_map(
            lambda spec, sub: jax.tree_util.tree_map(
                lambda _: self.NamedSharding(self.mesh, spec), sub),
            spec_tree, like, is_leaf=is_spec)
