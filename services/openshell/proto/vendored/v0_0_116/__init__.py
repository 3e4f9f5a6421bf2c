"""OpenShell 0.0.116's protocol (the stable SDK line), generated from openshell-0.0.116.binpb."""
