"""The OpenAI-compatible HTTP API over the engine: its config section (config.py), its requests
(models.py) and responses (responses.py), the parsing of a request into engine requests
(parsing.py), the endpoints (handlers.py) and the server (server.py).

Nothing is imported here, so that `app.api.config` (which the `kvstore` command reads for every
subcommand) does not pull in aiohttp or the engine.
"""
