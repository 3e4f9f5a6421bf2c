"""OpenShell's released protocols, exactly as the PyPI wheels compiled them: one descriptor set
per release (``openshell-<version>.binpb``, written by ``vendor.py``) and its generated modules
(``v<version>/``, by ``generate.py``), under sandstream's package names."""
