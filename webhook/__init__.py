"""The validating admission webhook: a thin adapter around :mod:`vramguard.admission`.

``models`` decodes the AdmissionReview, ``state`` keeps what the watches show (namespaces, GPU
nodes, live GPU pods), ``app`` answers ``POST /validate``, ``main`` runs it all over HTTPS.
"""
