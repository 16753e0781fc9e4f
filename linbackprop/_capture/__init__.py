"""Networks found in models: ``layers=``, `capture` and `layer`.

Users have models, not Networks. With ``layers=`` naming which calls of ``fun`` are the layers
(classes whose instances' calls are layers, or functions decorated with `layer`), ``fun``
is traced once per shapes with each such call made opaque: a ``jax.jit`` of the call, named so
that it is found again (``linbackprop_layer<k>``). The jaxpr then shows the DAG directly:

- each marked call is a layer; its parameter blocks are the leaves of the differentiated
  arguments it reads (a leaf read by two calls, or by a call and the code around it, is shared),
  its states the values computed before it, its inputs the data;
- the code between the calls that computes what a later call reads (residual adds, norms,
  reshapes, an embedding lookup) is made of layers of its own (glue, one per run of equations
  between two calls);
- what follows — what no later call reads — is the loss ℓ of the network's outputs, as the code
  around a Network call is in ``grad_by_solve``.

The equations are split into three parts, evaluated in this order: before the network (data
preparation, terms of the arguments alone), the network (one ``Network`` call, differentiated
by the solve), after it (the loss). Layer functions are built from the jaxprs of the calls and
of the glue; equal programs (same jaxpr text, constants and reads) share one function object,
so that repeated blocks are one kind of layer and a Python loop over blocks does not grow the
program. The Network is cached per captured program: tracing ``fun`` again with the same shapes
finds the same Network, and the solve's caches hit.

Modules: `_marks` (marking the calls), `_inlining` (the user's jits and scans flattened),
`_stacks` (stacked outputs read as one `Stack`), `_program` (the jaxpr split into data /
network / loss), `_rewrite` (``fun`` around the network), `_network_calls` (the same marking for
the calls of `Network` s: the curvature transforms' split of a function into its network calls
and the loss).
"""

from ._marks import layer
from ._network_calls import NetworkCalls
from ._program import Capture
from ._rewrite import Rewritten, capture, rewrite

__all__ = ["Capture", "NetworkCalls", "Rewritten", "capture", "layer", "rewrite"]
