"""CPU, GPU and TPU without the devices: every public transform and both optax transforms, jitted,
lowered for CUDA, ROCm and TPU through ``jax.export`` (cross-platform lowering needs no device
of the kind). A primitive without a lowering rule for one of them, or a host callback, fails
here. Custom calls that ``jax.export`` does not guarantee to stay serializable (LAPACK-style
solvers, as ``eigh`` and ``cholesky`` lower to on GPU) are allowed: the guarantee is about
reloading a serialized program in a later jaxlib, not about running it now.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import linbackprop as lbp

PLATFORMS = ("cuda", "rocm", "tpu")
# GPU solvers (cuSOLVER / hipSOLVER, as jnp.linalg lowers to) and their helpers
ALLOWED = [jax.export.DisabledSafetyCheck.custom_call(f"{prefix}_{op}_ffi")
           for prefix in ("cusolver", "hipsolver")
           for op in ("syevd", "syevj", "potrf", "geqrf", "orgqr", "ormqr", "getrf", "gesvdj", "gesvd")]
ALLOWED += [jax.export.DisabledSafetyCheck.custom_call(target) for target in
            ("cu_lu_pivots_to_permutation", "hip_lu_pivots_to_permutation", "cublas_geqrf_batched_ffi",
             "hipblas_geqrf_batched_ffi")]


def _problem():
    dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    net = lbp.Network([lbp.Layer(1, dense, (0,), ("W0", "b0")), lbp.Layer(2, dense, (1,), ("W1", "b1"))], [0], 2)
    k = jax.random.split(jax.random.key(0), 3)
    params = {"W0": jax.random.normal(k[0], (3, 4)), "b0": jnp.zeros(4),
              "W1": jax.random.normal(k[1], (4, 2)), "b1": jnp.zeros(2)}
    x = jax.random.normal(k[2], (5, 3))
    loss = lambda p, x: 0.5 * jnp.mean(jnp.sum(net(p, x) ** 2, axis=1))
    losses = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2, axis=1)
    return net, params, x, loss, losses


def _transforms(name):
    """The jitted function and its arguments for one case: each public transform, and a step of
    each optax transform."""
    net, params, x, loss, losses = _problem()
    tangent = jax.tree.map(jnp.ones_like, params)
    key = jax.random.key(1)
    marked = lbp.layer(lambda th, u: jnp.tanh(u @ th["W"]))

    def kfac_step(p, state):
        value, grad, G = lbp.gauss_newton(loss)(p, x)
        factors = lbp.kfac_factors(loss, samples=1, key=key)(p, x)
        updates, state = lbp.kfac().update(grad, state, p, factors=factors, curvature=G, value=value,
                                           value_fn=lambda q, **_: loss(q, x))
        return optax.apply_updates(p, updates), state

    def scale_by_kfac_step(p, state):
        grad = lbp.grad_by_solve(loss)(p, x)
        return lbp.scale_by_kfac().update(grad, state, p, factors=lbp.kfac_factors(loss)(p, x))

    def gauss_newton_step(p, state):
        _, grad, G = lbp.gauss_newton(loss)(p, x)
        return lbp.scale_by_gauss_newton().update(grad, state, p, curvature=G, value_fn=lambda q, **_: loss(q, x))

    def linearized(p, x):
        lin = lbp.linearize(net, p, x)
        return lin.M.mv(lin.L.T.solve({1: jnp.zeros((5, 4)), 2: jnp.ones((5, 2))}))

    lifted = lbp.forward_laplacian(net)
    cases = {
        "grad_by_solve": lambda: (lbp.grad_by_solve(loss), (params, x)),
        "value_and_grad_by_solve": lambda: (lbp.value_and_grad_by_solve(loss), (params, x)),
        "jvp_by_solve": lambda: (lambda p, t: lbp.jvp_by_solve(loss, (p, x), (t, jnp.zeros_like(x))),
                                 (params, tangent)),
        "gauss_newton": lambda: (lambda p, v: (lambda G: (G.mv(v), G.gram([v, v])))(lbp.gauss_newton(loss)(p, x)[2]),
                                 (params, tangent)),
        "per_example_grads": lambda: (lbp.per_example_grads(losses), (params, x)),
        "per_example_grad_norms": lambda: (lbp.per_example_grad_norms(losses), (params, x)),
        "clipped_grad": lambda: (lbp.clipped_grad(losses, 1.0), (params, x)),
        "diag_ggn": lambda: (lbp.diag_ggn(loss), (params, x)),
        "diag_ggn sampled": lambda: (lbp.diag_ggn(loss, samples=2, key=key), (params, x)),
        "ggn_factor": lambda: (lbp.ggn_factor(loss), (params, x)),
        "kfac_factors": lambda: (lbp.kfac_factors(loss), (params, x)),
        "kfac_factors sampled": lambda: (lbp.kfac_factors(loss, samples=1, key=key), (params, x)),
        "forward_laplacian": lambda: (lambda p, x: lbp.grad_by_solve(lambda q: jnp.sum(lifted(q, x)[2] ** 2))(p),
                                      (params, x)),
        "linearize": lambda: (linearized, (params, x)),
        "layers=": lambda: (lbp.grad_by_solve(lambda p, x: jnp.sum(marked(p, x) ** 2), layers=marked),
                            ({"W": params["W0"]}, x)),
        # the state after one update: the steps from then on, with the factors' averages
        "kfac": lambda: (kfac_step, (params, jax.jit(kfac_step)(params, lbp.kfac().init(params))[1])),
        "scale_by_kfac": lambda: (scale_by_kfac_step, (params, lbp.scale_by_kfac().init(params))),
        "scale_by_gauss_newton": lambda: (gauss_newton_step, (params, lbp.scale_by_gauss_newton().init(params))),
    }
    return cases[name]() if name else list(cases)


@pytest.mark.parametrize("name", _transforms(None))
def test_every_transform_lowers_for_gpu_and_tpu(name):
    fn, args = _transforms(name)
    exported = jax.export.export(jax.jit(fn), platforms=PLATFORMS, disabled_checks=ALLOWED)(*args)
    assert exported.platforms == PLATFORMS
    assert "stablehlo" in exported.mlir_module()
