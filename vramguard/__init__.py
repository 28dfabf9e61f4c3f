"""vramguard: count bytes of VRAM, not GPU replicas.

This package is the pure core: decisions only, no network, no Kubernetes client, no NVML.
"""

__version__ = "0.1.0"
