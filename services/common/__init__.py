"""What every role shares: settings, metrics, the PostgreSQL pool, migrations, task supervision
and the process entry point. Imports no other package of services/."""
