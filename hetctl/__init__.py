"""hetctl: train one model across accelerators from many vendors."""

__version__ = "0.1.0"
