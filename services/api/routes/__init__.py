"""One ``APIRouter`` per resource: commands, sandboxes, history, watch and operations
(health, readiness, metrics); ``services.api.app`` includes them in this order."""
