"""`python -m services.openshell`: the OpenShell-compatible gRPC API as its own role."""

from services.openshell.server import main

main()
