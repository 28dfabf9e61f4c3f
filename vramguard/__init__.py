"""vramguard: count bytes of VRAM, not GPU replicas.

Every module here except ``vramguard.io`` (the I/O adapters) and ``vramguard.cli`` (the command
line) is the pure core: decisions only, no network, no Kubernetes client, no NVML.
"""

__version__ = "0.2.0"
