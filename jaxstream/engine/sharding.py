"""Tensor-parallel placement of parameters and KV pages over an optional device mesh.

Projections into heads / the MLP hidden layer are split on their output features, projections back to
the model width on their input features, embeddings on the vocabulary; KV pages are split on the KV-head
axis. A dimension that does not divide by the mesh axis stays replicated, so any model runs on any
mesh (tiny test models included). Without a mesh everything stays on the default device. The per-channel
scales of int8 weights (models/quantization.py) go with their weight's output channels: split where the weight
is split on them (projections into heads, embeddings), replicated where it is split on its inputs.
"""
import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# (path fragment, dimension of the weight split over the tensor-parallel axis, whether that dimension holds its
# output channels: the one its int8 scales run along)
_RULES = (
    ("q_proj", -1, True), ("k_proj", -1, True), ("v_proj", -1, True), ("gate_proj", -1, True),
    ("up_proj", -1, True), ("o_proj", 0, False), ("down_proj", 0, False), ("embed_tokens", 0, True),
    ("lm_head", -1, True),
)


class Placement:
    def __init__(self, mesh, axis: str):
        if mesh is not None:
            if axis not in mesh.axis_names:
                raise ValueError(f"the mesh has no axis {axis!r} (axes: {mesh.axis_names})")
            # The step programs rely on XLA's sharding propagation: use the mesh's devices with auto axes
            # (jax.make_mesh gives explicit axes, which would demand an out_sharding for every gather).
            mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        self.mesh = mesh
        self.axis = axis
        self.size = mesh.shape[axis] if mesh is not None else 1

    def _sharding(self, spec):
        return NamedSharding(self.mesh, spec)

    def replicated(self):
        return self._sharding(P()) if self.mesh is not None else None

    def kv_sharding(self, stack_spec):
        if self.mesh is None:
            return None
        if stack_spec.num_kv_heads % self.size:
            return self.replicated()
        return self._sharding(P(None, self.axis, None, None))

    def param_sharding(self, path, shape: tuple[int, ...]):
        """The sharding of the parameter at NNX state `path` (also the `load_model` sharding rule)."""
        name = "/".join(str(part) for part in path)
        is_scale = bool(path) and str(path[-1]) == "scale"
        for fragment, dim, outputs in _RULES:
            if fragment not in name:
                continue
            if is_scale:  # [outputs]: divides exactly when the weight's output dimension does
                dim = 0 if outputs else None
            elif len(shape) < 2:
                continue
            if dim is not None and shape[dim] % self.size == 0:
                spec = [None] * len(shape)
                spec[dim] = self.axis
                return self._sharding(P(*spec))
        return self.replicated()

    def program_shardings(self, model, cache) -> dict:
        """Keyword arguments of `steps.Programs`: shardings of params, the donated state and the batch."""
        if self.mesh is None:
            return {}
        _, params = nnx.split(model)
        param_shardings = jax.tree_util.tree_map_with_path(lambda path, leaf: self.param_sharding(path, leaf.shape),
                                                            params)
        return dict(param_shardings=param_shardings, state_shardings=cache.shardings,
                    batch_sharding=self.replicated())
