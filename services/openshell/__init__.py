"""OpenShell's gRPC API (``openshell.v1.OpenShell``) served over sandstream: the subset protos
and their generated modules (``proto/``), the pure mapping between the two resource models
(``mapping``), the servicer (``service``), the server (``server``, in ``sandstream up`` or as
its own role) and the runners of OpenShell's conformance suite and CLI (``conformance``).
"""
