"""HAMi's scheduler extender (Project-HAMi/HAMi, Go) as the throughput benchmark's peer.

``python -m bench.extender --only throughput --extender hami --hami-source DIR`` runs HAMi's
``cmd/scheduler`` in the extender's place: built from a HAMi source tree (:func:`peer.build_hami`),
started through :mod:`bench.hami.launch` (the harness's extender command line translated to
HAMi's flags), wired into the second kube-scheduler as HAMi's Helm chart wires it
(:func:`peer.scheduler_config`), on nodes annotated as HAMi's device plugin registers them
(:func:`peer.node_annotations`), with pods asking for what HAMi reads (:func:`peer.pod_resources`).
"""
