"""The subset of OpenShell's protos that sandstream serves (``*.proto``, wire-compatible with
OpenShell's) and the modules grpcio-tools generates from them (committed; ``generate``)."""
