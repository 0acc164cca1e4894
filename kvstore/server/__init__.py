"""The store's services: the REST admin API (admin.py, its OpenAPI document in openapi.py and
its dashboard.html) and the Prometheus metrics (metrics.py).

`kvstore serve` and `kvstore sidecar` start the admin API next to their own work:

    metrics = Metrics(store, engine)                 # engine: an LLM / AsyncLLM, or None
    app = create_admin_app(store, config, engine, metrics)
    runner = await start_admin(app, config)          # KVStoreError: exposed without a token, port taken
    ...                                              # on SIGTERM: set_draining(app), then drain
    await runner.cleanup()
"""

from kvstore.server.admin import admin_url, create_admin_app, set_draining, start_admin
from kvstore.server.metrics import Metrics

__all__ = ["Metrics", "admin_url", "create_admin_app", "set_draining", "start_admin"]
