"""Property-based: random DAGs, every argnum and forward mode, against jax.grad / jax.jvp at 1e-9.

A drawn network has 1–3 inputs and 2–12 layers listed in random order; each layer reads 1–3
earlier states; widths include 1; blocks are shared between layers, sometimes twice in one
layer, some are pytrees (dicts), some are rows of a stacked block (lbp.Row); one or several
outputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from trees import assert_trees_close

import linbackprop as lbp

ACTIVATIONS = {"tanh": jnp.tanh, "sin": jnp.sin, "softplus": jax.nn.softplus}


def make_layer_fn(activation: str, pytree_bias: bool):
    """One function per (activation, bias kind): layers of equal shapes share a kind."""
    act = ACTIVATIONS[activation]

    def layer(theta, *inputs):
        *weights, bias = theta
        z = sum(u @ w for u, w in zip(inputs, weights))
        if pytree_bias:
            return act(z * bias["scale"] + bias["shift"])
        return act(z + bias)

    layer.__name__ = f"{activation}{'_pytree' if pytree_bias else ''}"
    return layer


FNS = {(a, p): make_layer_fn(a, p) for a in ACTIVATIONS for p in (False, True)}


@st.composite
def dags(draw):
    n_inputs = draw(st.integers(1, 3))
    n_layers = draw(st.integers(2, 12))
    widths = {f"x{i}": draw(st.integers(1, 3)) for i in range(n_inputs)}
    blocks: dict = {}  # name -> shape (or dict of shapes); rows of "R" are (3, 3) weights
    stacked_rows = 0
    layers = []
    rng_seed = draw(st.integers(0, 2**16))
    for n in range(n_layers):
        name = f"h{n}"
        earlier = list(widths)
        reads = draw(st.lists(st.sampled_from(earlier), min_size=1, max_size=min(3, len(earlier)), unique=True))
        width = draw(st.integers(1, 3))
        params = []
        for r in reads:
            shape = (widths[r], width)
            same_shape = [b for b, s in blocks.items() if s == shape]
            if same_shape and draw(st.booleans()):  # share a block (possibly one this layer already uses)
                params.append(draw(st.sampled_from(same_shape)))
            elif shape == (3, 3) and draw(st.booleans()):
                params.append(lbp.Row("R", stacked_rows))
                stacked_rows += 1
            else:
                blocks[f"W{len(blocks)}"] = shape
                params.append(f"W{len(blocks) - 1}")
        pytree_bias = draw(st.booleans())
        bias_shape = {"scale": (), "shift": (width,)} if pytree_bias else (width,)
        same_bias = [b for b, s in blocks.items() if s == bias_shape]
        if same_bias and draw(st.booleans()):
            params.append(draw(st.sampled_from(same_bias)))
        else:
            blocks[f"B{len(blocks)}"] = bias_shape
            params.append(f"B{len(blocks) - 1}")
        fn = FNS[(draw(st.sampled_from(sorted(ACTIVATIONS))), pytree_bias)]
        layers.append(lbp.Layer(name, fn, tuple(reads), tuple(params)))
        widths[name] = width
    names = [layer.name for layer in layers]
    outputs = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    single = len(outputs) == 1 and draw(st.booleans())
    order = draw(st.permutations(layers))
    net = lbp.Network(order, [f"x{i}" for i in range(n_inputs)], outputs[0] if single else outputs)

    rng = np.random.default_rng(rng_seed)
    rand = lambda *shape: jnp.asarray(0.7 * rng.standard_normal(shape))
    params = {b: ({k: rand(*v) for k, v in s.items()} if isinstance(s, dict) else rand(*s)) for b, s in blocks.items()}
    if stacked_rows:
        params["R"] = rand(stacked_rows + 1, 3, 3)  # one spare row: its gradient is zero
    inputs = tuple(rand(2, widths[f"x{i}"]) for i in range(n_inputs))
    return net, params, inputs


def loss_of(net):
    def loss(params, *inputs):
        outs = net(params, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(jnp.sin(o) + 0.5 * o**2) for o in outs)

    return loss


def assert_close(actual, expected):
    assert_trees_close(actual, expected, rtol=1e-9, atol=1e-12)


@given(dags(), st.sampled_from(["loop", "unrolled"]))
def test_random_dag_gradients_and_jvp(dag, engine):
    net, params, inputs = dag
    loss = loss_of(net)
    argnums = tuple(range(1 + len(inputs)))
    ours = jax.jit(lbp.grad_by_solve(loss, argnums, engine=engine))(params, *inputs)
    assert_close(ours, jax.jit(jax.grad(loss, argnums))(params, *inputs))
    primals = (params, *inputs)
    rng = np.random.default_rng(0)
    tangents = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), primals)
    out, tan = jax.jit(lambda p, t: lbp.jvp_by_solve(loss, p, t, engine=engine))(primals, tangents)
    ref_out, ref_tan = jax.jit(lambda p, t: jax.jvp(loss, p, t))(primals, tangents)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12)
    np.testing.assert_allclose(tan, ref_tan, rtol=1e-9, atol=1e-12)
