"""Data parallelism over 8 simulated CPU devices, in a subprocess (the device count is fixed when
JAX starts): the same gradients as on one device, and replicated."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data_parallel.py"


def test_data_parallel_gradients_on_eight_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8 devices, batch 32" in done.stdout
    assert "gradients replicated: True" in done.stdout
    difference = float(done.stdout.split("largest difference to one device ")[1].split(";")[0])
    assert difference < 1e-5


SCRIPT = """
import jax, jax.numpy as jnp, pytest
from jax.sharding import NamedSharding, PartitionSpec as P
import linbackprop as lbp
net = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "y")
mesh = jax.make_mesh((8,), ("data",))  # Explicit axes (the default): a clear error, not a wrong answer
x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
loss = lambda p, x: jnp.sum(net(p, x))
with pytest.raises(NotImplementedError, match="network input 'x'.*AxisType.Auto"):
    jax.jit(lbp.grad_by_solve(loss))({"W": jnp.ones((4, 2))}, x)
print("clear error")
"""


def test_explicit_sharding_gets_a_clear_error():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "clear error" in done.stdout
