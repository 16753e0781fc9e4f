"""plot_network: small networks on one line as before; repeated kinds of layer on lanes of their own."""

import matplotlib
import pytest

import linbackprop as lbp
from linbackprop._graph._layer import label
from linbackprop._pictures._demo import digits_network
from linbackprop._pictures._plots import layout

matplotlib.use("Agg")


def attention(th, x):
    return x


def mlp(th, x):
    return x


def transformer(blocks=12):
    """26 layers for 12 blocks: embed, (attention, MLP) × 12, logits tied to the embedding."""
    layers, previous = [lbp.Layer("embed", lambda th, t: t, ("tokens",), ("wte", "wpe"))], "embed"
    for i in range(blocks):
        layers += [lbp.Layer(("attn", i), attention, (previous,), (lbp.Row("attn", i),)),
                   lbp.Layer(("mlp", i), mlp, (("attn", i),), (lbp.Row("mlp", i),))]
        previous = ("mlp", i)
    layers.append(lbp.Layer("logits", lambda th, x: x, (previous,), ("ln_f", "wte")))
    return lbp.Network(layers, ["tokens"], "logits")


def test_layout_puts_each_repeated_kind_on_its_own_lane():
    net = transformer()
    places = layout(net)
    assert len(net.layers) == 26
    assert {places[("attn", i)][1] for i in range(12)} == {0}
    assert {places[("mlp", i)][1] for i in range(12)} == {-1}
    assert places["tokens"] == (0, 0) and places["embed"] == (1, 0) and places["logits"] == (26, 0)
    assert [places[name][0] for name in net.order] == list(range(1, 27))


def test_layout_of_a_small_network_is_one_line():
    assert {y for _, y in layout(digits_network()).values()} == {0}


def test_plot_network_of_a_transformer_names_kinds_and_the_tied_embedding():
    ax = lbp.plot_network(transformer())
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["attention ×12: attn[i]", "mlp ×12: mlp[i]", "wte: shared by embed, logits"]
    assert "('mlp', 11)" in [t.get_text() for t in ax.texts]
    matplotlib.pyplot.close(ax.figure)


@pytest.mark.parametrize("gap", [2, 7])
def test_plot_network_draws_every_skip_arc(gap):
    layers = [lbp.Layer(i, attention if i % 2 else mlp, (i - 1,)) for i in range(1, 20)]
    layers.append(lbp.Layer(20, lambda th, u, s: u + s, (19, 19 - gap)))
    ax = lbp.plot_network(lbp.Network(layers, [0], 20))
    orange = [line for line in ax.lines if line.get_color() == "tab:orange"]
    assert len(orange) == 1  # one skip: one arc (its arrow head is an annotation)
    matplotlib.pyplot.close(ax.figure)


@pytest.mark.parametrize("steps", [5, 30])
def test_plot_network_of_an_rnn_reading_rows_of_a_stacked_input(steps):
    """Row reads (x_t of a stacked input) are listed, not drawn: they crashed plot_network."""
    layers = [lbp.Layer(t, attention, (t - 1, lbp.Row("xs", t - 1)), ("A",)) for t in range(1, steps + 1)]
    ax = lbp.plot_network(lbp.Network(layers, [0, "xs"], lbp.Stack(range(1, steps + 1))))
    texts = [t.get_text() for t in ax.texts]
    if steps == 5:
        assert "A\nxs[4]" in texts
    else:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["attention ×30: A; reads xs[i]"]
    matplotlib.pyplot.close(ax.figure)


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


def test_every_node_of_a_small_network_is_its_labels_own_box():
    """A long state name ("logits") widens its node instead of overflowing a fixed circle."""
    net = digits_network()
    ax = lbp.plot_network(net)
    ax.figure.canvas.draw()  # boxes take their size when drawn
    renderer = ax.figure.canvas.get_renderer()
    names = {label(n) for n in [*net.inputs, *net.order]}
    nodes = [t for t in ax.texts if t.get_text() in names]
    assert {t.get_text() for t in nodes} == names
    for text in nodes:
        box = text.get_bbox_patch()
        assert box is not None, text.get_text()
        inner, outer = _extent(text, renderer), _extent(box, renderer)
        assert outer.x0 <= inner.x0 and inner.x1 <= outer.x1 and outer.y0 <= inner.y0 and inner.y1 <= outer.y1
    matplotlib.pyplot.close(ax.figure)


def test_the_demo_figure_fills_its_dag_panel_and_explains_the_columns_of_m_star():
    from linbackprop._operators._linearization import linearize
    from linbackprop._pictures._demo import demo_figure
    from linbackprop._pictures._seed_network import seed_problem

    net, theta, u0, _ = seed_problem()
    fig = demo_figure(linearize(net, theta, u0), digits_network(), [1.0, 0.5, 0.25])
    lower, m_star, dag = fig.axes[0], fig.axes[1], fig.axes[2]
    assert "ℒ" in lower.get_title() and "ℳ*" in m_star.get_title()
    assert [t.get_text() for t in m_star.get_xticklabels()] == [f"θ{k}" for k in net.param_names]
    assert "order of first use" in m_star.get_xlabel()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    drawn = [_extent(t, renderer) for t in dag.texts]
    panel = dag.get_window_extent(renderer)
    height = max(b.y1 for b in drawn) - min(b.y0 for b in drawn)
    assert height >= 0.4 * panel.height  # the nodes, arcs' labels and blocks: not a line in a big empty square
    assert panel.width >= 1.3 * panel.height  # a wide panel for a network drawn left to right
    matplotlib.pyplot.close(fig)


def test_legend_of_a_captured_loop_lists_a_kinds_blocks_as_patterns():
    """Blocks named by their paths in a model (a Python loop over blocks found by layers=): one
    pattern per block of a layer, the numbers that vary written ``i``, the shared prefix once."""
    import jax.numpy as jnp

    @lbp.layer
    def attn(p, h):
        return h + jnp.tanh(h @ p["qkv"]["kernel"] + p["qkv"]["bias"]) @ p["out"]

    @lbp.layer
    def feed(p, h):
        return h + jnp.tanh(h @ p["up"]) @ p["down"]

    def loss(params, x):
        for block in params["blocks"]:
            x = feed(block[1], attn(block[0], x))
        return jnp.sum(x**2)

    eye = jnp.eye(2)
    params = {"blocks": [[{"qkv": {"kernel": eye, "bias": jnp.zeros(2)}, "out": eye}, {"up": eye, "down": eye}]
                         for _ in range(3)]}
    cap = lbp.capture(loss, params, jnp.ones((1, 2)), layers=(attn, feed))
    ax = lbp.plot_network(cap.net)
    # kinds in order of first use: the first attn, which reads the input, is of the others' kind
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "attn ×3: ['blocks'][i][0] {['qkv']['kernel'], ['qkv']['bias'], ['out']}",
        "feed ×3: ['blocks'][i][1] {['up'], ['down']}"]
    matplotlib.pyplot.close(ax.figure)
