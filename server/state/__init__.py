"""Persistent state: typed ORM, Alembic migrations, and the repository that the server and CLI use."""
