from alembic import context
from changeover.registry.db import engine_for
from changeover.registry.models import Base

url = context.config.get_main_option("sqlalchemy.url")
with engine_for(url).connect() as connection:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
