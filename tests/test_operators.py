"""ℒ and ℳ of lbp.linearize against dense matrices built independently with jax.jacfwd of the
layer functions, dense numpy solves, and the gradient formula ∇θJ = ℳ (ℒ*)⁻¹ ∇Uℓ + ∇θℓ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from networks import REGISTRY

import linbackprop as lbp

TINY = ["chain", "seed", "skips", "densenet", "rnn", "lstm", "multi_input"]


def flat(tree_dict, names):
    return np.asarray(ravel_pytree([tree_dict[n] for n in names])[0])


def dense_phi_jacobians(case):
    """D_UΦ and D_θΦ from jax.jacfwd of Φ(U, θ) written out layer by layer (not the library)."""
    net, lin = case.net, lbp.linearize(case.net, case.params, *case.inputs)
    states = lin.states
    layer_names, pnames = net.order, net.param_names
    _, unravel_u = ravel_pytree([states[n] for n in layer_names])
    _, unravel_p = ravel_pytree([case.params[p] for p in pnames])

    def phi(u_flat, p_flat):
        u = dict(zip(layer_names, unravel_u(u_flat)))
        u.update(zip(net.inputs, case.inputs))
        p = dict(zip(pnames, unravel_p(p_flat)))
        out = [layer.fn(tuple(p[k] for k in layer.params), *(u[r] for r in layer.reads)) for layer in net.layers]
        return ravel_pytree(out)[0]

    u0 = jnp.asarray(flat(states, layer_names))
    p0 = jnp.asarray(flat(case.params, pnames))
    return lin, np.asarray(jax.jacfwd(phi, 0)(u0, p0)), np.asarray(jax.jacfwd(phi, 1)(u0, p0))


@pytest.fixture(params=TINY)
def case(request):
    return REGISTRY[request.param]()


@pytest.mark.users_settings
def test_todense_matches_independent_jacobians(case):
    lin, DU, DT = dense_phi_jacobians(case)
    L = np.asarray(lin.L.todense())
    np.testing.assert_allclose(L, np.eye(len(L)) - DU, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lin.L.T.todense()), L.T, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lin.M.T.todense()), DT, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lin.M.todense()), DT.T, atol=1e-12)


def test_products_and_solves_match_dense(case):
    lin, DU, DT = dense_phi_jacobians(case)
    net = case.net
    L = np.eye(len(DU)) - DU
    rng = np.random.default_rng(0)
    rand = lambda tree: jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), tree)
    g = {n: rand(lin.states[n]) for n in net.order}  # names of mixed types: no tree_map over the dict
    h = {p: rand(case.params[p]) for p in net.param_names}
    gv, hv = flat(g, net.order), flat(h, net.param_names)
    np.testing.assert_allclose(flat(lin.L.mv(g), net.order), L @ gv, atol=1e-12)
    np.testing.assert_allclose(flat(lin.L.T.mv(g), net.order), L.T @ gv, atol=1e-12)
    np.testing.assert_allclose(flat(lin.L.solve(g), net.order), np.linalg.solve(L, gv), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(flat(lin.L.T.solve(g), net.order), np.linalg.solve(L.T, gv), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(flat(lin.M.mv(g), net.param_names), DT.T @ gv, atol=1e-12)
    np.testing.assert_allclose(flat(lin.M.T.mv(h), net.order), DT @ hv, atol=1e-12)


def test_patterns(case):
    lin = lbp.linearize(case.net, case.params, *case.inputs)
    net = case.net
    index = {n: i for i, n in enumerate(net.order)}
    expected = np.eye(len(index), dtype=bool)
    for layer in net.layers:
        for r in layer.reads:
            if r in index:
                expected[index[layer.name], index[r]] = True
    np.testing.assert_array_equal(lin.L.pattern, expected)
    np.testing.assert_array_equal(lin.L.T.pattern, expected.T)
    pidx = {p: k for k, p in enumerate(net.param_names)}
    m = np.zeros((len(pidx), len(index)), dtype=bool)
    for layer in net.layers:
        for p in layer.params:
            m[pidx[p], index[layer.name]] = True
    np.testing.assert_array_equal(lin.M.pattern, m)
    np.testing.assert_array_equal(lin.M.T.pattern, m.T)


def test_gradient_by_the_formula(case):
    """∇θJ = ℳ Λ + ∇θℓ with ℒ* Λ = ∇Uℓ, assembled by hand from the public operators."""
    from linbackprop._options._settings import calls_handled

    net = case.net
    lin = lbp.linearize(net, case.params, *case.inputs)
    layer_states = [lin.states[n] for n in net.order]  # a list: names may be of mixed types

    def ell(state_list, params):
        """ℓ(U, θ): the loss with the network's outputs read from the given states."""
        states = dict(zip(net.order, state_list))

        def frozen(n, p, x):  # the network's outputs are read from the states given
            if n is not net:
                return n(p, *x)
            return net.pick_outputs(states)

        with calls_handled(frozen):
            return case.loss(params, *case.inputs)

    grad_u, grad_theta = jax.grad(ell, (0, 1))(layer_states, case.params)
    lam = lin.L.T.solve(dict(zip(net.order, grad_u)))
    m_lam = lin.M.mv(lam)
    expected = jax.grad(case.loss)(case.params, *case.inputs)
    for p in net.param_names:
        got = jax.tree.map(jnp.add, m_lam[p], grad_theta[p])
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected[p])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-9, atol=1e-12)


def test_seed_patterns_counts():
    lin = lbp.linearize(REGISTRY["seed"]().net, REGISTRY["seed"]().params, *REGISTRY["seed"]().inputs)
    assert lin.L.pattern.shape == (6, 6) and lin.L.pattern.sum() == 14
    assert np.tril(lin.L.pattern, -1).sum() == 8
    assert lin.M.pattern.shape == (13, 6)
    assert lin.M.pattern[list(lin.net.param_names).index(3)].sum() == 2  # shared weight θ₃
    assert lin.M.pattern[list(lin.net.param_names).index(11)].sum() == 2  # shared bias θ₁₁


def test_blocks_hold_map_and_adjoint():
    case = REGISTRY["skips"]()
    lin = lbp.linearize(case.net, case.params, *case.inputs)
    rng = np.random.default_rng(1)
    e = jnp.asarray(rng.standard_normal(np.shape(lin.states["a"])))
    lam = jnp.asarray(rng.standard_normal(np.shape(lin.states["d"])))
    block = lin.L.block("d", "a")
    # ⟨ℒ_da e, λ⟩ = ⟨e, ℒ_da* λ⟩
    np.testing.assert_allclose(jnp.vdot(block.mv(e), lam), jnp.vdot(e, block.T.mv(lam)), rtol=1e-12)
    with pytest.raises(KeyError, match="does not read"):
        lin.L.block("d", "b")
    mb = lin.M.block("bb", "c")
    h = jnp.asarray(rng.standard_normal(4))
    lc = jnp.asarray(rng.standard_normal(np.shape(lin.states["c"])))
    np.testing.assert_allclose(jnp.vdot(mb.T.mv(h), lc), jnp.vdot(h, mb.mv(lc)), rtol=1e-12)


def test_vectors_must_have_all_keys():
    case = REGISTRY["chain"]()
    lin = lbp.linearize(case.net, case.params, *case.inputs)
    with pytest.raises(KeyError, match="missing \\['h3'\\]"):
        lin.L.mv({"h1": lin.states["h1"], "h2": lin.states["h2"]})


def test_one_operator_type_for_operators_and_blocks():
    """ℒ, ℳ, their adjoints and their blocks are all LinearOperators: mv, T, todense, pattern,
    block; solve where the operator is invertible, a clear error elsewhere."""
    case = REGISTRY["skips"]()
    lin = lbp.linearize(case.net, case.params, *case.inputs)
    for op in (lin.L, lin.L.T, lin.M, lin.M.T):
        assert isinstance(op, lbp.LinearOperator)
    dense_l = np.asarray(lin.L.todense())
    sizes = [int(np.size(lin.states[n])) for n in case.net.order]
    edges = np.concatenate([[0], np.cumsum(sizes)])
    at = {n: slice(edges[k], edges[k + 1]) for k, n in enumerate(case.net.order)}
    for i, j in [("c", "b"), ("d", "a"), ("e", "e")]:
        block = lin.L.block(i, j)
        assert isinstance(block, lbp.LinearOperator) and block.pattern.shape == (1, 1)
        np.testing.assert_allclose(block.todense(), dense_l[at[i], at[j]], atol=1e-12)
        np.testing.assert_allclose(lin.L.T.block(j, i).todense(), dense_l[at[i], at[j]].T, atol=1e-12)
        np.testing.assert_allclose(block.T.T.block(i, j).todense(), block.todense())
    ones = jnp.ones_like(lin.states["e"])
    np.testing.assert_allclose(lin.L.block("e", "e").solve(ones), ones)
    with pytest.raises(NotImplementedError, match="ℳ is not invertible"):
        lin.M.solve({n: lin.states[n] for n in case.net.order})
    with pytest.raises(NotImplementedError, match="not invertible"):
        lin.L.block("c", "b").solve(ones)


def test_a_block_of_a_state_read_twice_holds_both_reads():
    net = lbp.Network([lbp.Layer("y", lambda th, a, b: a * b * th[0], ("x", "x"), ("w",)),
                       lbp.Layer("z", lambda th, a, b: jnp.sin(a) + 3.0 * b, ("y", "y"))], ["x"], "z")
    lin = lbp.linearize(net, {"w": jnp.array(2.0)}, jnp.array([0.5, 1.0]))
    dense = np.asarray(lin.L.todense())
    np.testing.assert_allclose(lin.L.block("z", "y").todense(), dense[2:4, 0:2], atol=1e-12)
