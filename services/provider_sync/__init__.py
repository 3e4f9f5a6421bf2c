"""The provider-sync role (``sandstream provider-sync``; inside ``sandstream up`` when a source
is configured): keeps providers in step with an outside source through the API's provider
service (services/api/providers.py, the one place updates are decided and receipted).

- ``controller``: ``ProviderSync``, the reconcile loop (one update of every changed provider),
  and ``sync_source``, the source the arguments or settings name.
- ``sources``: the directory source and the rules shared by every source (valid names,
  skipped files and keys, one Secret's mapping to a provider).
- ``kube_secrets``: the Kubernetes Secrets source (loaded only when configured).
- ``service``: the provider service of a provider-sync process (its own pool and producer).

Imports common, api.
"""
