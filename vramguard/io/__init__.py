"""The I/O adapters: the layer between the pure core and the services, the only one that speaks
HTTP, TLS and the Kubernetes API.

- ``vramguard.io.kube``: the only module talking to the API server (client, informers, stores).
- ``vramguard.io.supervise``: running a service's tasks, and exiting when one of them dies.

- ``vramguard.io.certs``: a private CA and serving certificates for a Service's DNS names.
- ``vramguard.io.tls``: a server TLS context that follows its certificate files.
- ``vramguard.io.http``: the aiohttp application factory (probes, metrics, body limits, JSON errors).
- ``vramguard.io.server``: serving over HTTPS until SIGTERM, with graceful shutdown.
"""
