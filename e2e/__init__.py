"""End-to-end tests and a local Kubernetes control plane built from source (see README.md)."""
