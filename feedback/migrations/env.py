"""Alembic environment: the engine comes from Flywheel's settings (`feedback.db.upgrade`)."""

from alembic import context

from feedback.db import metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # `alembic` run by hand: build the engine from the configured URL
    from feedback.core.config import StackSettings
    from feedback.db import make_engine

    connection = make_engine(StackSettings.load().database_url).connect()

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
