"""Data parallelism over 8 simulated CPU devices, in a subprocess (the device count is fixed when
JAX starts): the same gradients as on one device, and replicated."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # .ci/run's second interpreter skips these

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data_parallel.py"
# 8 simulated devices are 8 threads on this machine's cores, shared with the other test worker:
# XLA CPU aborts a collective whose threads do not all arrive within 40 s (seen under load).
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=900"


def eight_devices() -> dict:
    """The environment of a fresh process on 8 CPU devices, compiling as the tests do (the
    conftest's XLA flags kept: at XLA's defaults these processes took twice as long)."""
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {EIGHT_DEVICES}".strip(),
            "JAX_PLATFORMS": "cpu"}


def test_data_parallel_gradients_on_eight_devices():
    env = eight_devices()
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8 devices, batch 32, Auto axes" in done.stdout and "8 devices, batch 32, Explicit axes" in done.stdout
    assert done.stdout.count("gradients replicated: True") == 2
    differences = [float(part.split(";")[0]) for part in done.stdout.split("largest difference to one device ")[1:]]
    assert len(differences) == 2 and max(differences) < 1e-5


EXPLICIT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import linbackprop as lbp

mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: jax.make_mesh's default
assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
jax.set_mesh(mesh)
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
D = 18


def megatron(th, u):  # column-parallel then row-parallel weights, the user's own out_sharding annotations
    h = jnp.tanh(jnp.einsum("bd,df->bf", u, th[0], out_sharding=P("data", "model")))
    return u + jnp.einsum("bf,fd->bd", h, th[1], out_sharding=P("data", None))


def residual(th, u):
    return u + jnp.tanh(u @ th[0])


k = jax.random.split(jax.random.key(0), 4)
x = put(jax.random.normal(k[0], (16, 8)), "data")
W1, W2 = 0.3 * jax.random.normal(k[1], (D, 8, 6)), 0.3 * jax.random.normal(k[2], (D, 6, 8))
W = 0.3 * jax.random.normal(k[3], (D, 8, 8))
tp = lbp.Network([lbp.Layer(i, megatron, (i - 1,), (lbp.Row("W1", i - 1), lbp.Row("W2", i - 1)))
                  for i in range(1, D + 1)], [0], D)
tp_shallow = lbp.Network([lbp.Layer(i, megatron, (i - 1,), (("W1", i), ("W2", i))) for i in range(1, 4)], [0], 3)
chain = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, D + 1)], [0], D)
cases = {
    "tensor-parallel": (tp, {"W1": put(W1, None, None, "model"), "W2": put(W2, None, "model", None)}),
    "tensor-parallel, one array per block": (
        tp_shallow, {**{("W1", i): put(W1[i], None, "model") for i in range(1, 4)},
                     **{("W2", i): put(W2[i], "model", None) for i in range(1, 4)}}),
    "fsdp": (chain, {"W": put(W, None, "data", None)}),
    "data-parallel": (chain, {"W": put(W, None, None, None)}),
}
for name, (net, params) in cases.items():
    loss = lambda p, x: jnp.mean(net(p, x) ** 2)
    ref_value, ref = jax.jit(jax.value_and_grad(loss))(params, x)
    single = jax.grad(loss)(jax.device_get(params), np.asarray(x))  # one device, no sharding
    for settings in (dict(engine="loop"), dict(engine="unrolled"), dict(param_products="in_loop"), dict(remat=True)):
        value, grads = jax.jit(lbp.value_and_grad_by_solve(loss, **settings))(params, x)
        assert np.allclose(value, ref_value, rtol=1e-5), (name, settings)
        for g, r, s in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), jax.tree.leaves(single)):
            assert g.sharding.is_equivalent_to(r.sharding, g.ndim), (name, settings, g.sharding, r.sharding)
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(g, s, rtol=1e-4, atol=1e-6)
    tangents = jax.tree.map(jnp.ones_like, params)
    out, tan = jax.jit(lambda p, t: lbp.jvp_by_solve(lambda p: loss(p, x), (p,), (t,)))(params, tangents)
    ref_out, ref_tan = jax.jit(lambda p, t: jax.jvp(lambda p: loss(p, x), (p,), (t,)))(params, tangents)
    np.testing.assert_allclose(tan, ref_tan, rtol=1e-4)
    print("ok", name)
"""


def test_explicit_sharding_data_tensor_and_fully_sharded_parallel():
    """Explicit mesh axes (jax.make_mesh's default): the same values as on one device, and the
    gradients sharded as jax.grad shards them."""
    env = eight_devices()
    done = subprocess.run([sys.executable, "-c", EXPLICIT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("tensor-parallel", "tensor-parallel, one array per block", "fsdp", "data-parallel"):
        assert f"ok {name}\n" in done.stdout


WITHOUT_SET_MESH = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import linbackprop as lbp

from linbackprop._options._policy import Policy
from linbackprop._options._settings import Settings, using
# checkpoints=2 as asked: the segments' shardings are under test
using(Settings(policy=Policy(checkpoint_saving=float("inf"), checkpoint_bound=float("inf")))).__enter__()
mesh = jax.make_mesh((8,), ("data",))  # Explicit axes, and no jax.set_mesh
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
D = 6
residual = lambda th, u: u + jnp.tanh(u @ th[0])
chain = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, D + 1)], [0], D)
shallow = lbp.Network([lbp.Layer(i, residual, (i - 1,), (("W", i),)) for i in range(1, 3)], [0], 2)
x = put(jax.random.normal(jax.random.key(0), (16, 8)), "data")
cases = {"row-stacked chain": (chain, {"W": put(0.3 * jax.random.normal(jax.random.key(1), (D, 8, 8)))}),
         "one array per block": (shallow, {("W", i): put(0.3 * jnp.eye(8) + 0.01 * i) for i in range(1, 3)})}
for name, (net, params) in cases.items():
    loss = lambda p, x: jnp.mean(net(p, x) ** 2)
    ref = jax.jit(jax.grad(loss))(params, x)
    for settings in (dict(engine="loop"), dict(engine="unrolled"), dict(param_products="in_loop"),
                     dict(remat=True), dict(checkpoints=2)):
        grads = jax.jit(lbp.grad_by_solve(loss, **settings))(params, x)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
            assert g.sharding.is_equivalent_to(r.sharding, g.ndim), (name, settings, g.sharding, r.sharding)
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    print("ok", name)
"""


def test_explicitly_sharded_batch_without_set_mesh():
    """Batch on NamedSharding(mesh, P("data")), parameters replicated, no ``jax.set_mesh``: jitted
    gradients as jax.grad's, with its shardings (the ℳΛ products contract over the sharded batch)."""
    env = eight_devices()
    done = subprocess.run([sys.executable, "-c", WITHOUT_SET_MESH], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == 2


KFAC_PROBLEM = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import linbackprop as lbp

jax.config.update("jax_enable_x64", True)
dense = lambda th, x: jnp.tanh(x @ th[0] + th[1])
linear = lambda th, x: x @ th[0] + th[1]
net = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")), lbp.Layer("y", linear, ("h",), ("W2", "b2"))],
                  ["x"], "y")
rng = np.random.default_rng(0)
params = {"W1": rng.standard_normal((5, 7)) / 2, "b1": np.zeros(7),
          "W2": rng.standard_normal((7, 3)) / 2, "b2": np.zeros(3)}
x, labels = rng.standard_normal((32, 5)), rng.integers(0, 3, 32)
loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(net(p, x), y).mean()
# the state's structure from init (one program per mesh, not a second trace at step 2)
shapes = jax.eval_shape(lambda p: lbp.gauss_newton(loss, factors=True, samples=1, key=jax.random.key(0))(
    p, x, labels)[2].factors, params)
opt = lbp.kfac(factors=shapes)
local = lambda a: np.asarray(a.addressable_data(0))  # this process's copy of a replicated array


def step(p, s, x, y, i):  # the one-pass K-FAC step
    key = jax.random.fold_in(jax.random.key(1), i)
    value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(p, x, y)
    updates, s = opt.update(grad, s, p, curvature=G)
    return optax.apply_updates(p, updates), s, value


def run(p, x, y, steps=6):
    s, values, jitted = opt.init(p), [], jax.jit(step)
    for i in range(steps):
        p, s, value = jitted(p, s, x, y, i)
        values.append(float(local(value)))
    return p, values


def check(name, p, values, one_p, one_values):
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(p)), name
    np.testing.assert_allclose(values, one_values, rtol=1e-10)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(one_p)):
        np.testing.assert_allclose(local(a), local(b), rtol=1e-8, atol=1e-10)
    print("ok", name)
"""

ONE_PASS_KFAC = KFAC_PROBLEM + """
one_p, one_values = run(*jax.device_put((params, x, labels), jax.devices()[0]))  # one device
for name, kind in (("automatic", AxisType.Auto), ("explicit", AxisType.Explicit)):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    with jax.set_mesh(mesh):  # explicit axes: the trace-time checks' random values need JAX's mesh
        check(name, *run(jax.tree.map(put, params), put(x, "data"), put(labels, "data")), one_p, one_values)
"""

# each process: 4 CPU devices, gloo's collectives, its half of the batch on one global mesh of 8
TWO_PROCESSES_KFAC = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
process = int(sys.argv[1])
jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[2]}", num_processes=2, process_id=process)
""" + KFAC_PROBLEM + """
one_p, one_values = run(*jax.device_put((params, x, labels), jax.local_devices()[0]))  # one device here
half = slice(16 * process, 16 * (process + 1))
for name, kind in (("automatic", AxisType.Auto), ("explicit", AxisType.Explicit)):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    whole = lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, P()), a)
    rows = lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), a[half])
    with jax.set_mesh(mesh):
        check(name, *run(jax.tree.map(whole, params), rows(x), rows(labels)), one_p, one_values)
"""


def test_the_one_pass_kfac_step_with_the_batch_on_eight_devices():
    """``gauss_newton(factors=True)`` and ``lbp.kfac`` under ``jax.jit``, the batch sharded over 8
    devices (automatic and explicit meshes), parameters replicated: six steps equal to one
    device's, the parameters replicated."""
    env = eight_devices()
    done = subprocess.run([sys.executable, "-c", ONE_PASS_KFAC], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == 2, done.stdout


def test_the_one_pass_kfac_step_on_two_processes():
    """The same step on two processes of 4 CPU devices each (``jax.distributed`` with gloo's CPU
    collectives, one global mesh of 8, each process holding half of the batch): the values and
    parameters of one device. The trace-time checks run on random values sharded over the
    global mesh (arrays no single process addresses whole)."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    workers = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES_KFAC, str(i), str(port)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [w.communicate(timeout=600) for w in workers]
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
        assert out.count("ok ") == 2, out
