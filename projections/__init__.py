"""The lifecycle rules (a pure fold) and their projection into PostgreSQL."""
