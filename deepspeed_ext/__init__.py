"""deepspeed-ext: universal checkpoints for DeepSpeed AutoTP + ZeRO training.

Replace ``deepspeed.initialize`` with :func:`deepspeed_ext.initialize` and add
``"deepspeed_ext": {"universal_checkpoint": {"enabled": true}}`` to the DeepSpeed config.
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in replacement for ``deepspeed.initialize`` (same arguments, same return tuple)."""
    from deepspeed_ext.runtime import initialize as _initialize
    return _initialize(*args, **kwargs)


__all__ = ["initialize", "__version__"]
