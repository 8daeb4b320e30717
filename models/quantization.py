"""Weight-only int8 quantization (`--quantization int8`, `EngineConfig.quantization`): int8 weights with one
float32 scale per output channel; activations and the KV cache stay in the compute dtype.

Symmetric, per output channel: `scale = max|w| / 127` over the channel's inputs and `q = round(w / scale)` in
[-127, 127], so `|w - q * scale| <= scale / 2`. A layer computes `(x @ q) * scale`: the scale comes after the
matmul, the same math as `x @ (q * scale)`, and the dot's operand is the int8 kernel converted to the compute
dtype, a conversion XLA's TPU and GPU compilers fuse into the matmul's read of it (the CPU backend converts the
whole kernel first: int8 decode steps are slower on a CPU, benchmarks/quantization.py). The dot accumulates in
float32 and the scale is applied in float32 before the one rounding to the compute dtype.

What is quantized: every `nnx.Linear` (attention and MLP projections, Voxtral's adapter and delay-conditioning
projections, an untied LM head) and the token embedding (`nnx.Embed`), whose one scale per vocabulary row serves
both the lookup and a tied LM head (`hidden @ E^T`: a row of E is an output channel of the head). Voxtral
Realtime 4B: 4.43 G parameters, 403 M of them in the tied embedding; the conv stem (5.4 M, 0.1 %), norms and
biases stay in the parameter dtype. Weights halve against bfloat16 (8.86 -> 4.44 GB), quarter against float32.

`quantize_model` quantizes a loaded model; `models/loading.py` quantizes each tensor as it reads it
(`quantize_structure` gives the abstract int8 model, `int8_weights` the paths to quantize), so loading never
holds more of the float model than the tensors in flight.
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

QUANTIZATION_METHODS = ("int8",)
_INT8_MAX = 127


def check_method(method: str | None) -> None:
    """Raises ValueError naming the choices for a quantization method jaxstream does not implement."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {method!r}")


@functools.partial(jax.jit, static_argnums=1)
def quantize_weight(weight, axis: int):
    """(int8 q, float32 scale) of `weight`, one scale per index of the other axis; `axis` holds a channel's inputs.

    A channel of zeros gets scale 0 and q 0 (exact)."""
    w = weight.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=axis) / _INT8_MAX
    divisor = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis)
    q = jnp.clip(jnp.round(w / divisor), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


class Int8Linear(nnx.Module):
    """`nnx.Linear` with an int8 kernel [in, out] and float32 per-output scales: y = (x @ q) * scale + bias."""

    INPUT_AXIS = 0  # of the kernel: what one scale covers

    def __init__(self, kernel, scale, bias=None, *, dtype=None, preferred_element_type=None):
        self.kernel = nnx.Param(kernel)
        self.scale = nnx.Param(scale)
        self.bias = nnx.Param(bias) if bias is not None else nnx.data(None)
        self.in_features, self.out_features = kernel.shape
        self.dtype = dtype
        self.preferred_element_type = preferred_element_type

    @classmethod
    def like(cls, linear: nnx.Linear, quantize: bool) -> "Int8Linear":
        """The int8 form of `linear`: its weights quantized, or zeros of the right shapes (an abstract model)."""
        if quantize:
            kernel, scale = quantize_weight(linear.kernel[...], cls.INPUT_AXIS)
        else:
            kernel = jnp.zeros((linear.in_features, linear.out_features), jnp.int8)
            scale = jnp.zeros((linear.out_features,), jnp.float32)
        bias = linear.bias[...] if linear.bias is not None else None
        return cls(kernel, scale, bias, dtype=linear.dtype, preferred_element_type=linear.preferred_element_type)

    def __call__(self, x):
        dtype = self.dtype or x.dtype
        y = jnp.einsum("...i,io->...o", x.astype(dtype), self.kernel[...].astype(dtype),
                       preferred_element_type=jnp.float32)
        y = (y * self.scale[...]).astype(self.preferred_element_type or dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Int8Embed(nnx.Module):
    """`nnx.Embed` with an int8 table [V, D] and a float32 scale per row; `attend` is the tied LM head over it."""

    INPUT_AXIS = 1

    def __init__(self, embedding, scale, *, dtype):
        self.embedding = nnx.Param(embedding)
        self.scale = nnx.Param(scale)
        self.num_embeddings, self.features = embedding.shape
        self.dtype = dtype

    @classmethod
    def like(cls, embed: nnx.Embed, quantize: bool) -> "Int8Embed":
        if quantize:
            table, scale = quantize_weight(embed.embedding[...], cls.INPUT_AXIS)
        else:
            table = jnp.zeros((embed.num_embeddings, embed.features), jnp.int8)
            scale = jnp.zeros((embed.num_embeddings,), jnp.float32)
        return cls(table, scale, dtype=embed.dtype)

    def __call__(self, ids):
        rows = jnp.take(self.embedding[...], ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(self.scale[...], ids, axis=0)[..., None]).astype(self.dtype)

    def attend(self, hidden):
        """float32 logits hidden @ E^T of a tied head ([..., D] -> [..., V])."""
        logits = jnp.einsum("...d,vd->...v", hidden, self.embedding[...].astype(hidden.dtype),
                            preferred_element_type=jnp.float32)
        return logits * self.scale[...]


_INT8_FORMS = {nnx.Linear: Int8Linear, nnx.Embed: Int8Embed}


def _float_layers(model: nnx.Module) -> list[tuple[nnx.Module, str | int, nnx.Module]]:
    """(parent, attribute or index, layer) of every float layer that has an int8 form."""
    found = []
    for path, layer in nnx.iter_modules(model):
        if type(layer) in _INT8_FORMS:
            parent = model
            for key in path[:-1]:
                parent = parent[key] if isinstance(key, int) else getattr(parent, key)
            found.append((parent, path[-1], layer))
    return found


def _replace_layers(model: nnx.Module, quantize: bool) -> nnx.Module:
    for parent, key, layer in _float_layers(model):
        int8 = _INT8_FORMS[type(layer)].like(layer, quantize)
        if isinstance(key, int):
            parent[key] = int8
        else:
            setattr(parent, key, int8)
    return model


def quantize_model(model: nnx.Module, method: str = "int8") -> nnx.Module:
    """A copy of `model` with int8 weights (see the module docstring); the other parameters are shared with it.

    The float model is left as it was: drop it to free its memory."""
    check_method(method)
    return _replace_layers(nnx.merge(*nnx.split(model)), quantize=True)


def quantize_structure(model: nnx.Module) -> nnx.Module:
    """`model` with its float layers replaced in place by zero int8 forms: under `nnx.eval_shape`, the abstract
    int8 model a loader fills (`int8_weights`)."""
    return _replace_layers(model, quantize=False)


def int8_weights(model: nnx.Module) -> dict[tuple, int]:
    """NNX state path of each int8 weight of `model` -> the axis its scale reduces (the scale is its sibling
    `scale`): where a loader quantizes the float tensor it reads (`quantize_weight(tensor, axis)`)."""
    weights = {}
    for path, layer in nnx.iter_modules(model):
        if isinstance(layer, Int8Linear):
            weights[tuple(path) + ("kernel",)] = Int8Linear.INPUT_AXIS
        elif isinstance(layer, Int8Embed):
            weights[tuple(path) + ("embedding",)] = Int8Embed.INPUT_AXIS
    return weights


def is_quantized(model: nnx.Module) -> bool:
    return any(isinstance(layer, (Int8Linear, Int8Embed)) for _, layer in nnx.iter_modules(model))
