"""Standalone slot tracker: active-request load accounting for KV-aware routers.

`core` holds the accounting (pure, synchronous), `app` the HTTP shell, `__main__` the CLI.
"""
