"""The seed's example, backbackback.jl, in linbackprop.

Builds the 6-layer network of "Batched Backpropagation as a Linear Solve" (skips 3←1, 5←2, 6←3;
layers 3 and 4 sharing weight and bias; K = 13 blocks), prints the patterns of ℒ and ℳ*, and
compares the gradient ∇θJ = ℳ((ℒ*)⁻¹∇Uℓ) + αθ with a central difference along a random
direction and with jax.grad. The code itself lives in ``linbackprop/_seed.py`` so that
``python -m linbackprop`` runs the same lines.

    python examples/seed_network.py
"""

from linbackprop._pictures._seed_network import main

if __name__ == "__main__":
    main()
