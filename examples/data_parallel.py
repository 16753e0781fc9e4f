"""Data-parallel gradients over several devices: batch sharded, parameters replicated.

Under jax.jit, inputs placed with NamedSharding(mesh, P("data")) and parameters with
NamedSharding(mesh, P()) are enough: the solve runs on every device on its shard of the batch
(the loops are per-example work), and XLA inserts the all-reduce that sums the parameter
gradients, which come back replicated. Both kinds of mesh axes work: Auto (XLA propagates the
shardings) and Explicit (jax.make_mesh's default: shardings are part of the arrays' types, and the
solve's buffers carry them).

    python examples/data_parallel.py                       # uses the devices you have
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py  # 8 CPU devices
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import linbackprop as lbp


def residual(theta, h):
    return h + jnp.tanh(h @ theta[0] + theta[1])


def main(depth: int = 6, width: int = 16, per_device_batch: int = 4) -> float:
    devices = jax.devices()
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], inputs=[0], outputs=depth)
    rng = np.random.default_rng(0)
    params = {"W": jnp.asarray(rng.standard_normal((depth, width, width)) / np.sqrt(width), jnp.float32),
              "b": jnp.zeros((depth, width), jnp.float32)}
    batch = per_device_batch * len(devices)
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    loss = lambda p, x, y: jnp.mean((net(p, x) - y) ** 2)
    grad = jax.jit(lbp.grad_by_solve(loss))

    one_device = grad(params, x, y)
    worst = 0.0
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(axis_type,))
        with jax.set_mesh(mesh):
            sharded = grad(jax.device_put(params, NamedSharding(mesh, P())),
                           jax.device_put(x, NamedSharding(mesh, P("data"))),
                           jax.device_put(y, NamedSharding(mesh, P("data"))))
        pairs = zip(jax.tree.leaves(sharded), jax.tree.leaves(one_device))
        difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
        replicated = all(g.sharding.is_fully_replicated for g in jax.tree.leaves(sharded))
        print(f"{len(devices)} devices, batch {batch}, {axis_type.name} axes: largest difference to one device "
              f"{difference:.1e}; gradients replicated: {replicated}")
        if not replicated:
            raise SystemExit("the gradients did not come back replicated")
        worst = max(worst, difference)
    return worst


if __name__ == "__main__":
    main()
