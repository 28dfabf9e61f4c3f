"""Plumbing shared by the scheduler extender and the admission webhook.

- ``service.certs``: a private CA and serving certificates for a Service's DNS names.
- ``service.tls``: a server TLS context that follows its certificate files.
- ``service.http``: the aiohttp application factory (probes, metrics, body limits, JSON errors).
- ``service.server``: serving over HTTPS until SIGTERM, with graceful shutdown.
"""
