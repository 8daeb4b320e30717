"""Test configuration: CPU only, float32 matmuls, 4 fake CPU devices for sharding tests."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "float32")
