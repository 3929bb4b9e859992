"""The engine: front-end input/output processing, engine core and its clients."""
