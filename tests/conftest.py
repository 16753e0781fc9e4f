import jax
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="module")
def always_checkpoint():
    """``checkpoints=k`` as asked, even where the memory rule would run the call without (the
    small networks of tests of the segments themselves keep no less by checkpointing)."""
    from linbackprop import _transforms

    saved, _transforms.checkpoints_keep_less = _transforms.checkpoints_keep_less, lambda *_: True
    yield
    _transforms.checkpoints_keep_less = saved
