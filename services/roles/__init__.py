"""The roles as separate long-lived processes: ``sandstream processor``, ``executor``,
``watcher``, ``scheduler`` and ``api``, each with its health endpoint (services/common/health.py)
and the exit codes of services/common/entrypoint.py; ``prepare`` readies the topics, schema and
credentials once before them. ``sandstream up`` stays the one-process local default.
"""
