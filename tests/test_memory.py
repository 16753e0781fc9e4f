"""Networks built and differentiated in a loop are not kept alive by linbackprop's caches (nor by
JAX's, through parameters of linbackprop's primitives): memory stays bounded."""

import gc
import weakref

import jax
import jax.numpy as jnp

import linbackprop as lbp
from linbackprop import _plan, _transforms


class Model:
    """What a layer closes over (a model with arrays)."""

    def __init__(self, n: int):
        self.scale = jnp.full((64, 64), float(n))


def test_networks_built_in_a_loop_are_released():
    x, p = jnp.ones((2, 4)), {"W": jnp.ones((4, 4))}
    first = None
    count = _plan.make_plan.cache_info().maxsize + _transforms.JITTED_NETWORKS + 8
    for n in range(count):
        model = Model(n)
        layer = lambda th, u, model=model: jnp.tanh(u @ th[0]) * model.scale[0, 0]
        net = lbp.Network([lbp.Layer("h", layer, ("x",), ("W",))], ["x"], "h")
        g = lbp.grad_by_solve(lambda p, x, net=net: jnp.sum(net(p, x) ** 2))(p, x)
        assert g["W"].shape == (4, 4)
        if first is None:
            first = weakref.ref(model)
        del model, layer, net
    gc.collect()
    assert first() is None  # the first network, its closure and its compiled solve are gone
    live = sum(isinstance(o, Model) for o in gc.get_objects())
    assert live <= _plan.make_plan.cache_info().maxsize  # at most what the plan cache keeps
    assert jax.tree.leaves(g)
