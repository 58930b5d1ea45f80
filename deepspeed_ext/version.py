"""The package's version, in a module of its own so that any module may read it without importing the package's
front door (``deepspeed_ext/__init__.py`` reaches up into the runtime)."""

__version__ = "0.1.0"
