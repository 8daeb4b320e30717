"""jaxstream: a pure-JAX engine for realtime streaming-input inference."""
__version__ = "0.1.0"
