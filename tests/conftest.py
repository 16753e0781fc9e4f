import jax
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="module")
def always_checkpoint():
    """``checkpoints=k`` as asked, even where the memory rule would run the call without (the
    small networks of tests of the segments themselves keep no less by checkpointing)."""
    from linbackprop._policy import Policy
    from linbackprop._settings import Settings, using

    with using(Settings(policy=Policy(checkpoint_saving=float("inf"), checkpoint_bound=float("inf")))):
        yield
