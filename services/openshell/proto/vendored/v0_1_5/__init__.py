"""OpenShell 0.1.5's protocol (names as canonical references), from openshell-0.1.5.binpb."""
