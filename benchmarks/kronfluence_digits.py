"""kronfluence's EK-FAC on the influence benchmark's digits MLP: its half of the side-by-side
(``benchmarks/influence_kronfluence.py``). It runs in an environment of its own (PyTorch on the
CPU, kronfluence from the package index), reading the weights and data the other half wrote
(``-P``: the folder of benchmarks/profile.py is not put before the standard library):

    python3.11 -m venv kf-env && kf-env/bin/pip install torch kronfluence
    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_kronfluence --export build/kf_in.npz
    OPENBLAS_NUM_THREADS=1 kf-env/bin/python -P benchmarks/kronfluence_digits.py build/kf_in.npz build/kf_out.npz
    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_kronfluence --compare build/kf_out.npz

The same network (ReLU 64-128-64-10, torch's ``nn.Linear`` holding our W transposed and b),
the same 1,000 training images and 300 queries, float32, one thread. kronfluence's task as its
examples write it: the training loss summed over the batch, the true Fisher (labels sampled
from the model, ``use_empirical_fisher=False``), the query's margin as the measurement. Scores
twice with the λ the other half used (its absolute value, ``damping_factor=λ``), with two seeds
of the sampled labels (their agreement: kronfluence's own noise), and once with its heuristic
(``damping_factor=None``: 0.1 × each module's mean eigenvalue), and once with 64 labels drawn
per example where it draws one, with two seeds, and with 1,024 (the same Fisher, converging to
what the exact columns of H give).
Seconds of fit + scores and the process's peak resident memory.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own alias
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch import nn
from torch.utils.data import TensorDataset


def margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    own = logits.gather(1, labels[:, None])[:, 0]
    others = logits.masked_fill(F.one_hot(labels, logits.shape[1]).bool(), float("-inf"))
    return own - torch.logsumexp(others, dim=1)


class Classification(Task):
    """kronfluence's classification task; ``draws`` labels sampled per example where it samples
    (the sum of their losses over √draws: the same Fisher in expectation, less noise)."""

    def __init__(self, draws: int = 1):
        self.draws = draws

    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        logits = model(x)
        if not sample:
            return F.cross_entropy(logits, y, reduction="sum")
        with torch.no_grad():
            drawn = torch.multinomial(F.softmax(logits.detach(), dim=-1), num_samples=self.draws, replacement=True)
        return -F.log_softmax(logits, dim=-1).gather(1, drawn).sum() / self.draws ** 0.5

    def compute_measurement(self, batch, model):
        x, y = batch
        return margin(model(x), y).sum()


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    data = np.load(source)
    layers = [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)]
    with torch.no_grad():
        for n, layer in enumerate(layers[::2]):
            layer.weight.copy_(torch.from_numpy(data[f"W{n}"].T.copy()))
            layer.bias.copy_(torch.from_numpy(data[f"b{n}"]))
    model = nn.Sequential(*layers).eval()
    train = TensorDataset(torch.from_numpy(data["train_x"]), torch.from_numpy(data["train_y"]).long())
    query = TensorDataset(torch.from_numpy(data["query_x"]), torch.from_numpy(data["query_y"]).long())
    out, seconds = {}, {}
    settings = [("fixed", 0, float(data["damping"]), 1), ("fixed_seed1", 1, float(data["damping"]), 1),
                ("heuristic", 0, None, 1), ("drawn64", 0, float(data["damping"]), 64),
                ("drawn64_seed1", 1, float(data["damping"]), 64), ("drawn1024", 0, float(data["damping"]), 1024)]
    with tempfile.TemporaryDirectory() as directory:
        for name, seed, damping, draws in settings:
            task = Classification(draws)
            model = prepare_model(model, task)
            analyzer = Analyzer("digits", model, task, cpu=True, disable_tqdm=True, output_dir=directory)
            torch.manual_seed(seed)
            start = time.perf_counter()
            analyzer.fit_all_factors(factors_name=f"ekfac{seed}", dataset=train, per_device_batch_size=1000,
                                     factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
            analyzer.compute_pairwise_scores(scores_name=name, factors_name=f"ekfac{seed}", query_dataset=query,
                                             train_dataset=train, per_device_query_batch_size=300,
                                             per_device_train_batch_size=1000,
                                             score_args=ScoreArguments(damping_factor=damping),
                                             overwrite_output_dir=True)
            seconds[name] = time.perf_counter() - start
            out[name] = analyzer.load_pairwise_scores(name)["all_modules"].numpy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    np.savez(target, seconds=np.array([seconds[name] for name, *_ in settings]), peak=np.array(peak), **out)
    print({k: f"{v:.1f} s" for k, v in seconds.items()}, f"peak RSS {peak / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
