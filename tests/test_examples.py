"""The demo and the examples run (at small sizes) and report what they promise."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from linbackprop._pictures._seed_network import main

pytestmark = pytest.mark.slow  # .ci/run's second interpreter skips these

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_example_reproduces_the_seed(capsys):
    result = main()
    out = capsys.readouterr().out
    assert "6×6 ℒ" in out and "14 stored blocks" in out and "8 below the diagonal" in out
    assert "6×13 ℳ*" in out
    assert result["versus_finite_difference"] < 1e-7
    assert result["versus_jax_grad"] < 1e-12
    assert result["formula_versus_grad_by_solve"] < 1e-12


def test_demo_entry_point(tmp_path):
    """`python -m linbackprop` as README runs it: seed checks, digits training, the PNG."""
    png = tmp_path / "demo.png"
    cmd = [sys.executable, "-m", "linbackprop", "--no-progress", "--out", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert "versus_finite_difference" in done.stdout and "held-out test accuracy" in done.stdout
    accuracy = float(done.stdout.split("held-out test accuracy ")[1].split()[0])
    assert accuracy >= 0.95  # README's promise for the default 30 epochs
    assert png.stat().st_size > 10_000 and f"wrote {png}" in done.stdout
    assert "usage: python -m linbackprop" in subprocess.run([sys.executable, "-m", "linbackprop", "--help"],
                                                             capture_output=True, text=True, check=True).stdout


def test_seed_script_runs():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "seed_network.py")], capture_output=True,
                          text=True, timeout=300, check=True)
    assert "versus_jax_grad" in done.stdout


def test_train_digits_agrees_with_jax_grad_through_training():
    with jax.enable_x64(False):
        result = load("train_digits").main(epochs=2, depth=2, hidden=32)
    assert result["max_grad_difference"] < 1e-4 and result["max_param_difference"] < 1e-4
    assert result["accuracy"] > 0.8


def test_rnn_sequence_learns():
    with jax.enable_x64(False):
        result = load("rnn_sequence").main(steps=60, length=6, hidden=16)
    assert result["final_loss"] < 0.5 * result["initial_loss"]


def test_rnn_sequence_learns_with_kfac():
    """lbp.kfac on the RNN (the readout as layers: a weight shared by every step): in 40 steps
    below a tenth of the error Adam's 60 steps reach from the same start (0.5 × initial)."""
    with jax.enable_x64(False):
        result = load("rnn_sequence").main(steps=40, length=6, hidden=16, optimizer="kfac")
    assert result["final_loss"] < 0.05 * result["initial_loss"]


def test_deep_residual_reports_times_and_agrees():
    with jax.enable_x64(False):
        result = load("deep_residual").main(depth=24, width=8, batch=4, repeats=2)
    assert result["difference"] < 1e-5
    assert {"grad_by_solve", "grad_by_solve (Row)", "jax.grad (unrolled)", "jax.grad (unrolled, Row)",
            "jax.grad (lax.scan)"} <= set(result)


def test_flax_and_equinox_train_and_agree_with_jax_grad():
    with jax.enable_x64(False):
        results = load("flax_and_equinox").main(steps=8, depth=2)
    assert set(results) == {"equinox", "flax nnx", "flax linen"}
    for r in results.values():
        assert r["max_grad_difference"] < 1e-4 and r["final_loss"] < r["first_loss"]
    assert results["equinox"]["rebuilt_type"] == "EqxBlock" and results["flax nnx"]["params_type"] == "State"


def test_transformer_lm_learns_samples_and_times_both(tmp_path):
    png = tmp_path / "loss.png"
    with jax.enable_x64(False):
        result = load("transformer_lm").main(steps=40, blocks=2, width=32, context=16, batch=16, out=str(png),
                                             progress=False, repeats=2)
    assert result["final_loss"] < result["losses"][0] - 1.0  # from ≈ ln(vocab) towards the unigram entropy
    assert result["gradient_difference"] < 1e-4
    assert set(result["times"]) == {"grad_by_solve", "jax.grad over lax.scan"}
    assert len(result["sample"]) == len("Return the ") + 300 and png.stat().st_size > 10_000


def test_transformer_lm_trains_with_kfac_from_blocks_per_position():
    """``--optimizer kfac``: lbp.kfac with one sampled column per token (H's blocks per position)
    lowers the loss."""
    with jax.enable_x64(False):
        result = load("transformer_lm").main(steps=7, blocks=1, width=16, context=8, batch=8, out=None,
                                             progress=False, repeats=1, optimizer_name="kfac")
    # the last steps' against the first (4.55 → 3.28 at step 7 at both XLA settings). Seven steps, not
    # twelve: in float32 at the suite's XLA level 0 the loss then jumps (9.69, 134, 4e6 at steps 8-10;
    # at XLA's defaults 4.55 at step 8, then down; inverse="factored" diverges at both) — an open
    # defect of K-FAC's robustness, the same at ce67e74, left to the K-FAC issue
    assert np.isfinite(result["losses"]).all() and min(result["losses"][-3:]) < result["losses"][0] - 0.5
    assert set(result["times"]) == {"lbp.kfac", "jax.grad over lax.scan"}


def test_a_kfac_step_of_a_transformer_completes_in_a_fresh_process_at_xla_defaults():
    """Two blocks' K-FAC step at XLA's default settings, no XLA flag set: JAX 0.10's CPU runtime
    ran two batched ``eigh`` at once and deadlocked (every thread waiting, 0 % CPU until killed;
    this run timed out at 150 s before the factorisations were put in turn, `_graph._in_turn`).
    A process of its own, so that no flag of the suite's reaches it."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "transformer_lm.py"), "--optimizer", "kfac",
                           "--steps", "2", "--blocks", "2", "--width", "16", "--context", "8", "--batch", "8",
                           "--out", "", "--no-progress"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "one training step" in done.stdout


def test_flax_gpt_as_written_matches_nnx_grad_learns_and_draws_its_network(tmp_path):
    png = tmp_path / "flax_gpt.png"
    with jax.enable_x64(False):
        result = load("flax_gpt").main(steps=24, blocks=2, width=16, context=8, batch=16, out=str(png), repeats=0,
                                       samples=10)  # the timing is the example's, not the test's
    assert result["versus_nnx_grad"] < 1e-4 * result["largest_entry"]  # float32, against nnx.grad
    assert result["final_loss"] < result["first_loss"] - 0.8
    # the network found: the embedding (glue), the blocks in order, the head; E shared by both ends
    assert result["layers"] == ["glue0", "Attention0", "Mlp0", "Attention1", "Mlp1", "Head0"]
    net = result["capture"].net
    assert "['embed']['embedding']" in net.layers[0].params and "['embed']['embedding']" in net.layers[-1].params
    assert list(net.inputs) == ["tokens.1"]  # eval mode: no dropout stream is read
    assert png.stat().st_size > 10_000


def test_private_digits_reports_epsilon_and_learns():
    with jax.enable_x64(False):
        result = load("private_digits").main(epochs=3, batch=64)
    assert 0 < result["epsilon"] < 10 and result["steps"] == 3 * 1437 // 64
    assert result["private_accuracy"] > 0.6 and result["public_accuracy"] > 0.85
    assert 0 < result["clipped_fraction"] <= 1


def test_gauss_newton_example_beats_adam(tmp_path):
    """Levenberg–Marquardt on G against Adam (best of three rates), the same short budget."""
    png = tmp_path / "gn.png"
    result = load("gauss_newton").main(["--seconds", "1.5", "--width", "12", "--out", str(png)])
    assert result["lm"] * 10 < result["adam"]
    assert png.stat().st_size > 10_000


def test_pinn_example_engd_beats_adam(tmp_path):
    """The Poisson PINN: exact ENGD and the probed Gauss–Newton step (the residuals' rows) far below
    the best Adam after as many steps (80 each): a budget of steps, not seconds, so that the other
    test worker's load cannot shrink it (a 3 s budget once gave the probed step 20 steps, 238
    alone; the time to an error is the example's and the training guide's, not this test's)."""
    png = tmp_path / "pinn.png"
    result = load("pinn_poisson").main(["--steps", "80", "--widths", "16", "--methods", "probe,engd,adam",
                                        "--out", str(png)])
    adam = min(v for k, v in result.items() if k.startswith("Adam"))
    assert result["ENGD (dense)"] * 10 < adam
    assert result["Gauss–Newton, probed (SVD)"] * 10 < adam
    assert png.stat().st_size > 10_000


def test_pinn_example_starts_from_a_file_or_a_named_draw(tmp_path, capsys):
    """--init uniform (equinox's ±1/√fan_in weights and biases), normal (normal/√fan_in weights,
    zero biases) and an .npz of W0, b0, W1, b1 layer by layer (Wi (fan_in, fan_out)): the file's
    arrays are the parameters, a misshaped one is named, and each method's row keeps its
    "L2 error" form."""
    pinn = load("pinn_poisson")
    uniform = pinn.initial_parameters((8,), "uniform", seed=3)
    assert np.max(np.abs(uniform["W0"])) <= 1 / np.sqrt(2) and np.max(np.abs(uniform["b0"])) > 0
    assert np.max(np.abs(uniform["Wout"])) <= 1 / np.sqrt(8)
    normal = pinn.initial_parameters((8,), "normal", seed=3)
    assert np.max(np.abs(normal["b0"])) == 0 and normal["W0"].shape == (2, 8)
    path = tmp_path / "start.npz"
    np.savez(path, W0=np.asarray(uniform["W0"]), b0=np.asarray(uniform["b0"]), W1=np.asarray(uniform["Wout"]),
             b1=np.asarray(uniform["bout"]))
    loaded = pinn.initial_parameters((8,), str(path))
    assert all(np.array_equal(loaded[k], uniform[k]) for k in uniform)
    with pytest.raises(ValueError, match=r"W0 is \(2, 8\).*needs \(2, 4\)"):
        pinn.initial_parameters((4,), str(path))
    result = pinn.main(["--steps", "2", "--widths", "8", "--methods", "probe", "--init", str(path), "--out", ""])
    assert list(result) == ["Gauss–Newton, probed (SVD)"]
    assert "L2 error" in capsys.readouterr().out


def test_burgers_reference_solves_the_equation_and_the_example_trains(tmp_path):
    """The Burgers example's Cole–Hopf reference satisfies u_t + u u_x − ν u_xx = 0 (central
    differences away from the shock), the initial and boundary values; its loss's residual rows
    give the gradient (Kᵀb) and the loss (½‖b‖²); a short run lowers the error."""
    burgers = load("burgers")
    h = 1e-4
    x, t = np.array([-0.7, -0.3, 0.4, 0.8]), np.array([0.2, 0.5, 0.3, 0.9])
    u = burgers.reference(x, t)
    u_t = (burgers.reference(x, t + h) - burgers.reference(x, t - h)) / (2 * h)
    u_x = (burgers.reference(x + h, t) - burgers.reference(x - h, t)) / (2 * h)
    u_xx = (burgers.reference(x + h, t) - 2 * u + burgers.reference(x - h, t)) / h ** 2
    np.testing.assert_allclose(u_t + u * u_x - burgers.NU * u_xx, 0, atol=1e-5)
    np.testing.assert_allclose(burgers.reference(np.array([-1.0, 1.0]), 0.6), 0, atol=1e-12)
    np.testing.assert_allclose(burgers.reference(x, 0.0), -np.sin(np.pi * x), atol=1e-15)
    params, batch, loss, error = burgers.make_problem((6, 6), interior=40, initial=12, boundary=10)
    from jax.flatten_util import ravel_pytree

    import linbackprop as lbp

    rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params, *batch)
    k = jax.vmap(lambda r: ravel_pytree(r)[0])(rows)
    np.testing.assert_allclose(k.T @ b, ravel_pytree(jax.grad(loss)(params, *batch))[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(0.5 * np.sum(np.asarray(b) ** 2), loss(params, *batch), rtol=1e-12)
    result = burgers.main(["--seconds", "3", "--widths", "8,8", "--out", str(tmp_path / "b.png")])
    assert result["error"] < float(error(params))
