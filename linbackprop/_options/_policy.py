"""Every measured rule of the solve in one place: where a loop pays, where ℳΛ is formed, when a
checkpointed call keeps less memory and how its nested levels are chosen.

A `Policy` is a frozen value carried by the settings (``Settings.policy``), so it is part of
jit's key with them, and a test injects one (``settings.using(Settings(policy=...))``) instead of
patching module globals. Each threshold names the measurement behind it; the numbers are in
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Policy:
    """The thresholds of the measured rules (defaults: the measurements named below).

    Attributes:
        loop_min_depth, loop_min_layers_per_kind: the substitutions run as a ``lax.fori_loop``
            over kinds from this many layers and this many layers per kind on average; shallower
            or more varied networks as straight-line code (`loop_pays`; measured with
            ``python benchmarks/profile.py engine-rule``: compile and run time, loop against
            unrolled).
        max_period: the longest pattern of kinds one loop iteration runs without a switch
            (shorter periods win ties: a transformer's blocks between embedding and head are
            period 1; same measurement).
        longest_checkpoint_period: the longest period of layer patterns tried when a checkpointed
            call's evenly spaced segments are not translates of each other (a search bound).
        compute_bound_elements_cpu, compute_bound_elements_elsewhere, compute_bound_rows_cpu:
            steps whose largest state has this many elements, or (on CPU) this many rows, are
            compute-bound: there ℳΛ after the loop saves no time but keeps every Λ
            (`after_loop_pays`; measured on chains of depth 128–256, widths 16–128 with
            ``python benchmarks/run.py --rows headline``; the accelerators' threshold is an
            estimate).
        after_loop_min_rows_cpu: with fewer rows each layer's weight product is an outer product
            that XLA on CPU forms in another layout and copies: a weights-sized temporary for no
            time saved (chain 128×64×1).
        checkpoint_saving, checkpoint_bound: a checkpointed call runs only where it is predicted
            to keep at most ``checkpoint_saving`` of the plain call's memory and bound to keep at
            most ``checkpoint_bound`` of it (the estimate was within 0.6–1.4× of
            ``memory_analysis()`` on chains, RNNs, a GPT and a DAG:
            ``python benchmarks/profile.py checkpoint-memory --sweep``).
        leaf_states_per_layer: the states a leaf segment of the nested schedule keeps per layer
            (its states, Λ, residuals and products; measured on RNNs against ``memory_analysis()``).
        level_states: what a nested level costs besides its parameter cotangents, in states.
        level_cost_scale: the weight of a level's parameter cotangents (0: levels chosen by the
            layers alone).
        max_levels: the deepest nesting tried.
        norm_chunk_bytes: per-example norms of rows used by several layers (an RNN's recurrent
            weight, a tied embedding) form each example's product or Gram matrices from all the
            uses; the norms and the clipped sum go in chunks of examples whose products stay
            under this many bytes (`norm_chunk`; measured with ``python benchmarks/run.py --rows
            private``: an RNN's clipped sum kept 2.8× a gradient's temporaries in one piece, 1.9×
            in 1 MiB chunks, 2.2× in 2 MiB ones, no less in 512 KiB ones).
        carried_back_max_kept: with ℳ* h formed before the loop, the back substitution carries Λ
            in the compact layout and sets each carried row of a full-layout Λ once it is
            complete, where the compact layout keeps at most this fraction of the full layout's
            state elements; elsewhere it runs in the full layout (`carried_back_pays`; measured
            with ``python benchmarks/run.py --rows gradients``, the rules injected, one run: the
            deep narrow chain, three rows kept of 514, 0.77 → 0.70 of jax.grad; the deep narrow
            DAG, whose skips keep nearly every row, 0.75 → 0.72, within that row's noise).
        contract_first_min_cpu, contract_first_max_cpu: ℳΛ after the loop sums each layer's
            outer products over the rows of its state; on CPU, where those rows number from the
            first to the second, the products run with the contracted axis moved last first
            (`contract_first_rows`, `_contractions`; measured on the VJP of tanh(u W) vmapped over
            the layers, ``contracted_last`` against JAX's product, 2/4/8/16/31 rows: 512 layers of
            width 32 1.13/0.62/0.73/0.76/0.90, 128 of width 64 1.16/0.92/0.89/0.99/1.00, 256 of
            width 16 0.62/0.43/0.61/0.84/1.04).
        batched_products_cpu, batched_products_elsewhere: ``G.gram``'s k products J v as one
            forward substitution vmapped over the k vectors (the accelerators: fewer, larger
            kernels; an estimate, not measured) or, on CPU, one after another
            (`batched_products_pay`; measured with ``python benchmarks/profile.py gram``, k = 2,
            K-FAC's step size and momentum: the digits MLP 2.3 → 1.5 ms, the Poisson PINN
            2-64-1 10.2 → 1.4 ms, deep-wide 36 → 21 ms; an RNN and a chain the same either way).
    """

    loop_min_depth: int = 6
    loop_min_layers_per_kind: int = 2
    max_period: int = 8
    longest_checkpoint_period: int = 16
    compute_bound_elements_cpu: int = 8192
    compute_bound_elements_elsewhere: int = 1 << 18
    compute_bound_rows_cpu: int = 32
    after_loop_min_rows_cpu: int = 2
    checkpoint_saving: float = 0.5
    checkpoint_bound: float = 1.0
    leaf_states_per_layer: float = 4.0
    level_states: float = 8.0
    level_cost_scale: float = 1.0
    max_levels: int = 6
    norm_chunk_bytes: int = 1 << 20
    carried_back_max_kept: float = 0.5
    contract_first_min_cpu: int = 4
    contract_first_max_cpu: int = 16
    batched_products_cpu: bool = False
    batched_products_elsewhere: bool = True

    def loop_pays(self, depth: int, kinds: int) -> bool:
        """Whether the substitutions pay as a loop over kinds (one compiled body for many steps)."""
        return depth >= self.loop_min_depth and depth >= self.loop_min_layers_per_kind * kinds

    def after_loop_pays(self, elements: int, rows: int, backend: str) -> bool:
        """Whether ℳ batched after the loop pays on ``backend`` for steps whose largest state has
        ``elements`` elements in ``rows`` rows: where they are latency-bound, from two rows on CPU."""
        if backend == "cpu":
            return (elements < self.compute_bound_elements_cpu and self.after_loop_min_rows_cpu <= rows
                    < self.compute_bound_rows_cpu)
        return elements < self.compute_bound_elements_elsewhere and rows >= 1

    def params_in_loop(self, param_products: str, remat: bool, *, unrolled: bool, shared: bool,
                       largest_state: tuple[int, int], backend: str, checkpointed: bool = False) -> bool:
        """Where ℳΛ is formed: after the loop, batched per kind, where that pays
        (`after_loop_pays`) — in the loop with ``remat`` (re-linearising every layer after the
        loop would cost a forward pass), when the solve is ``unrolled`` (little to batch), when
        steps are compute-bound or of one row, and when the members of every kind share all their
        blocks (``shared``: a recurrent network's weights, where ℳΛ adds into one small row;
        measured 0.7–1.0× jax.grad over lax.scan against 1.3–1.5× after the loop, T = 2048).

        Except in a segment of a checkpointed call (``checkpointed``: memory was asked for), an
        unrolled solve whose members share their blocks, whatever ``param_products`` says: after
        the loop their products are one product summed over them, where in the loop XLA keeps
        every layer's product alive for one fused sum (RNN, T = 2048, 45 checkpoints: 448 → 300 KB
        of temporaries)."""
        if checkpointed and unrolled and shared:
            return False
        if param_products != "auto":
            return param_products == "in_loop"
        return remat or unrolled or shared or not self.after_loop_pays(*largest_state, backend)

    def carried_back_pays(self, kept: int, full: int) -> bool:
        """Whether the back substitution after ℳ* h formed before the loop carries Λ (see
        ``carried_back_max_kept``), its compact layout keeping ``kept`` of ``full`` state elements."""
        return kept <= self.carried_back_max_kept * full

    def contract_first_rows(self, backend: str) -> tuple[int, int] | None:
        """The fewest and most rows whose outer products ℳΛ forms with the contracted axis moved
        last first on ``backend`` (None: never; see ``contract_first_max_cpu``)."""
        return (self.contract_first_min_cpu, self.contract_first_max_cpu) if backend == "cpu" else None

    def batched_products_pay(self, backend: str) -> bool:
        """Whether k products with one stored linearisation run as one vmapped substitution on
        ``backend`` (see ``batched_products_elsewhere``; on CPU XLA's batched products are slower
        than k plain ones)."""
        return self.batched_products_cpu if backend == "cpu" else self.batched_products_elsewhere

    def norm_chunk(self, batch: int, example_bytes: int) -> int:
        """Examples per chunk for per-example norms that take ``example_bytes`` each: as many as
        keep a chunk under ``norm_chunk_bytes``, the whole batch where that is one chunk."""
        size = max(1, self.norm_chunk_bytes // max(example_bytes, 1))
        chunks = -(-batch // size)
        even = next((n for n in range(chunks, 2 * chunks + 1) if batch % n == 0), chunks)  # no repeated examples
        return -(-batch // even)

    def checkpoints_pay(self, estimate: float, bound: float) -> bool:
        """Whether a checkpointed call predicted to keep ``estimate`` (bound: ``bound``) of the
        plain call's memory runs checkpointed."""
        return estimate <= self.checkpoint_saving and bound <= self.checkpoint_bound

    def nested_levels(self, layers: int, checkpoints: int, level_cost: float = 0.0) -> tuple[int, ...]:
        """The checkpoints of each level of the nested schedule for ``layers`` layers and at most
        ``checkpoints`` states in all: each level cuts each segment of the level above into evenly
        spaced segments (the last one shorter). Chosen to keep least, in states: at each level,
        per distinct segment length (each a program of its own, whose buffers XLA does not share
        with the others') the states it keeps and ``level_states``; ``level_cost`` per level (its
        scan's parameter cotangents: ≈ the parameters, in states) times ``level_cost_scale``;
        ``leaf_states_per_layer`` per layer of each distinct leaf segment. So remainders cost —
        a segment of another length is another program below it — and levels that divide the
        layers evenly win (RNN, 2048 = 8 · 8 · 8 · 4 steps, 45 states: 7 + 7 + 7). Each level
        recomputes every layer once more: d + 1 forward evaluations — memory like k and
        recomputations growing like log N, the binomial (revolve) schedule's trade-off."""
        return _nested_levels(self, layers, checkpoints, level_cost * self.level_cost_scale)


@functools.lru_cache(maxsize=256)
def _nested_levels(policy: Policy, layers: int, checkpoints: int, level_cost: float) -> tuple[int, ...]:
    @functools.cache
    def best(lengths: frozenset[int], budget: int, left: int) -> tuple[float, tuple[int, ...]]:
        leaves = (policy.leaf_states_per_layer * sum(lengths), ())
        if left == 0 or budget < 1 or max(lengths) <= 2:
            return leaves
        options = [leaves]
        top = max(lengths)
        spread = max(1, budget // left)
        ks = {spread, spread - 1, spread - 2, budget} | {n - 1 for n in range(2, min(top, budget + 1) + 1)
                                                         if top % n == 0 and n - 1 >= spread // 2}
        for k in sorted(x for x in ks if 1 <= x <= budget):
            below, kept, programs = set(), 0, 0
            for length in lengths:  # each distinct length: a program of its own, with its own buffers
                if k >= length - 1:  # too short to cut: handed to the level below as it is
                    below.add(length)
                    continue
                seg = -(-length // (k + 1))
                count = -(-length // seg)
                kept, programs = kept + count - 1, programs + 1
                below |= {seg, length - (count - 1) * seg}
            if programs:
                cost, rest = best(frozenset(below), budget - k, left - 1)
                options.append((cost + kept + programs * policy.level_states + level_cost, (k, *rest)))
        return min(options, key=lambda o: (o[0], len(o[1])))

    return best(frozenset({layers}), checkpoints, policy.max_levels)[1] or (checkpoints,)


POLICY = Policy()
