"""Network construction, validation and plain evaluation; errors are checked by message."""

import jax.numpy as jnp
import numpy as np
import pytest

import linbackprop as lbp

f1 = lambda th, x: x * th[0]
f2 = lambda th, a, b: a + b


def test_topological_order_ties_keep_given_order_and_param_names():
    layers = [lbp.Layer("c", f2, ("a", "b")), lbp.Layer("b", f1, ("x",), ("q",)),
              lbp.Layer("a", f1, ("x",), ("p", "q"))]
    net = lbp.Network(layers, ["x"], "c")
    assert net.order == ("b", "a", "c")
    assert net.param_names == ("q", "p")
    assert net.inputs == ("x",) and net.outputs == ("c",)


def test_states_and_call():
    net = lbp.Network([lbp.Layer("a", f1, ("x",), ("p",)), lbp.Layer("b", f2, ("a", "x"))], ["x"], ["b", "a"])
    states = net.states({"p": 3.0}, jnp.float64(2.0))
    assert set(states) == {"x", "a", "b"}
    assert float(states["b"]) == 8.0
    b, a = net({"p": 3.0}, 2.0)
    assert float(b) == 8.0 and float(a) == 6.0


def test_network_is_hashable_and_equal_by_structure():
    layer = lbp.Layer("a", f1, ("x",), ("p",))
    n1, n2 = lbp.Network([layer], ["x"], "a"), lbp.Network([layer], ["x"], "a")
    assert n1 == n2 and hash(n1) == hash(n2)
    assert n1 != lbp.Network([layer], ["x"], ["a"])
    with pytest.raises(AttributeError):
        n1.order = ()


@pytest.mark.parametrize(
    ("layers", "inputs", "outputs", "message"),
    [
        ([lbp.Layer("a", f1, ("x",)), lbp.Layer("a", f1, ("x",))], ["x"], "a",
         "Layer name 'a' is already used by another layer"),
        ([lbp.Layer("x", f1, ("x",))], ["x"], "x", "Layer name 'x' is already used by an input"),
        ([lbp.Layer("a", f1, ("nope",))], ["x"], "a", "Layer 'a' reads unknown state 'nope'"),
        ([lbp.Layer("a", f1, ("a",))], ["x"], "a", "Layer 'a' reads itself"),
        ([lbp.Layer("a", f2, ("x", "b")), lbp.Layer("b", f1, ("a",))], ["x"], "b", r"\['a', 'b'\] form a cycle"),
        ([lbp.Layer("a", f1, ("x",))], ["x"], "zz", "Unknown output 'zz'"),
        ([lbp.Layer("a", f1, ("x",))], ["x", "x"], "a", "Duplicate input name 'x'"),
        ([lbp.Layer("a", f1, ("x",))], "x", "a", "inputs must be a sequence of names"),
        ([], ["x"], "x", "at least one layer"),
    ],
)
def test_graph_errors(layers, inputs, outputs, message):
    with pytest.raises(lbp.GraphError, match=message):
        lbp.Network(layers, inputs, outputs)


def test_a_bad_graph_is_caught_as_a_value_error():
    """Code that guards a Network's construction with ``except ValueError`` catches every graph
    error, and the error names the culprit."""
    for layers, inputs, outputs in ([], ["x"], "x"), ([lbp.Layer("a", f1, ("a",))], ["x"], "a"):
        try:
            lbp.Network(layers, inputs, outputs)
        except ValueError as error:
            assert isinstance(error, lbp.GraphError) and str(error)
        else:
            pytest.fail("no error")


def test_layer_errors():
    with pytest.raises(TypeError, match="reads must be a sequence of names.*reads=\\('x',\\)"):
        lbp.Layer("a", f1, "x")
    with pytest.raises(TypeError, match="fn must be callable"):
        lbp.Layer("a", 3)


def test_missing_parameter_block_names_block_and_layer():
    net = lbp.Network([lbp.Layer("a", f1, ("x",), ("p",))], ["x"], "a")
    with pytest.raises(KeyError, match="block 'p' used by layer\\(s\\) \\['a'\\]"):
        net({}, 1.0)
    with pytest.raises(KeyError, match="block 'p'"):
        lbp.grad_by_solve(lambda p: net(p, 1.0))({"q": 1.0})


def test_wrong_number_of_inputs():
    net = lbp.Network([lbp.Layer("a", f1, ("x",), ("p",))], ["x"], "a")
    with pytest.raises(TypeError, match="1 input\\(s\\) \\['x'\\] but was called with 2"):
        net({"p": 1.0}, 1.0, 2.0)


def test_layer_failure_names_the_layer_and_shapes():
    net = lbp.Network([lbp.Layer("bad", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "bad")
    params, x = {"W": jnp.ones((4, 2))}, jnp.ones((3, 5))
    with pytest.raises(TypeError, match=r"(?s)Layer 'bad' failed.*float64\[3, 5\].*'W': float64\[4, 2\]"):
        net(params, x)
    with pytest.raises(TypeError, match="Layer 'bad' failed"):
        lbp.grad_by_solve(lambda p: jnp.sum(net(p, x)))(params)


def test_non_array_leaf_is_rejected():
    net = lbp.Network([lbp.Layer("a", lambda th, x: x * th[0], ("x",), ("p",))], ["x"], "a")
    with pytest.raises(TypeError, match="Parameter block 'p' has a leaf of type str"):
        net({"p": "three"}, jnp.ones(2))
    with pytest.raises(TypeError, match="Network input 'x' has a leaf of type object"):
        net({"p": 1.0}, [[1.0], object()])


def test_repr_shows_the_dag():
    net = lbp.Network([lbp.Layer("a", f1, ("x",), ("p",)), lbp.Layer("b", f2, ("a", "x"))], ["x"], "b")
    text = repr(net)
    assert "a = <lambda>(x; p)" in text and "b = <lambda>(a, x)" in text
    assert np.array_equal(lbp.linearize(net, {"p": 2.0}, jnp.ones(2)).L.pattern, [[True, False], [True, True]])


@pytest.mark.parametrize("returned,message", [
    (lambda th, x: None, "Layer 'a' returned no arrays"),
    (lambda th, x: {"h": x, "note": "text"}, "Layer 'a' returned a leaf of type str"),
])
def test_layer_returning_the_wrong_structure(returned, message):
    net = lbp.Network([lbp.Layer("a", returned, ("x",), ("p",)), lbp.Layer("b", f2, ("a", "x"))], ["x"], "b")
    with pytest.raises(TypeError, match=message):
        net({"p": 1.0}, jnp.ones(2))
    with pytest.raises(TypeError, match=message):
        lbp.grad_by_solve(lambda p: jnp.sum(net(p, jnp.ones(2))))({"p": 1.0})


def test_layer_output_of_the_wrong_shape_for_its_reader():
    """A layer whose state has the wrong shape is reported by the layer that cannot use it."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",)),
                       lbp.Layer("y", lambda th, h, x: h + x @ th[0], ("h", "x"), ("V",))], ["x"], "y")
    params, x = {"W": jnp.ones((3, 5)), "V": jnp.ones((3, 4))}, jnp.ones((2, 3))
    pattern = r"(?s)Layer 'y' failed.*reads \['h', 'x'\] with shapes \[float64\[2, 5\], float64\[2, 3\]\]"
    with pytest.raises(TypeError, match=pattern):
        net(params, x)
    with pytest.raises(TypeError, match=pattern):
        lbp.grad_by_solve(lambda p: jnp.sum(net(p, x)))(params)


def test_block_of_the_wrong_shape_for_a_layer_that_shares_it():
    net = lbp.Network([lbp.Layer("h", lambda th, x: x @ th[0], ("x",), ("W",)),
                       lbp.Layer("y", lambda th, h: h @ th[0], ("h",), ("W",))], ["x"], "y")
    with pytest.raises(TypeError, match=r"(?s)Layer 'y' failed.*'W': float64\[3, 2\]"):
        lbp.grad_by_solve(lambda p: jnp.sum(net(p, jnp.ones((1, 3)))))({"W": jnp.ones((3, 2))})


def test_row_blocks_are_checked():
    with pytest.raises(TypeError, match="non-negative int index"):
        lbp.Layer("a", f1, ("x",), (lbp.Row("W", -1),))
    with pytest.raises(lbp.GraphError, match="'W' is used whole by layer 'b' and by rows.*by layer 'a'"):
        lbp.Network([lbp.Layer("a", f1, ("x",), (lbp.Row("W", 0),)), lbp.Layer("b", f1, ("a",), ("W",))], ["x"], "b")
    net = lbp.Network([lbp.Layer("a", f1, ("x",), (lbp.Row("W", 2),))], ["x"], "a")
    message = r"Layer 'a' uses Row\(block='W', index=2\).*leaf shapes \[\(2, 3\)\]"
    with pytest.raises(ValueError, match=message):  # JAX would clamp the index silently
        net({"W": jnp.ones((2, 3))}, jnp.ones(3))
    with pytest.raises(ValueError, match=message):
        lbp.grad_by_solve(lambda p: jnp.sum(net(p, jnp.ones(3))))({"W": jnp.ones((2, 3))})


def test_params_must_be_a_mapping_and_networks_take_layers():
    net = lbp.Network([lbp.Layer("a", f1, ("x",), ("p",))], ["x"], "a")
    with pytest.raises(TypeError, match="params must be a mapping"):
        net([1.0], 1.0)
    with pytest.raises(TypeError, match="must be lbp.Layer objects"):
        lbp.Network([("a", f1)], ["x"], "a")
    with pytest.raises(lbp.GraphError, match="inputs must be a sequence of names.*\\['x'\\]"):
        lbp.Network([lbp.Layer("a", f1, ("x",), ("p",))], "x", "a")


def test_a_tuple_name_as_the_single_output():
    layers = [lbp.Layer(("h", 1), f1, ("x",), ("p",)), lbp.Layer(("h", 2), f1, (("h", 1),), ("p",))]
    assert lbp.Network(layers, ["x"], ("h", 2))({"p": 2.0}, 1.0) == 4.0
    assert lbp.Network(layers, ["x"], [("h", 2)])({"p": 2.0}, 1.0) == (4.0,)
    assert lbp.Network(layers, ["x"], (("h", 1), ("h", 2)))({"p": 2.0}, 1.0) == (2.0, 4.0)
