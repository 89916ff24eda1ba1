"""Standalone slot tracker: active-request load accounting for KV-aware routers.

`core` holds the accounting (pure, synchronous), `app` the HTTP shell, `snapshot` the state's
way out of the process and back (`/dump`, `--snapshot`, `--peers`), `__main__` the CLI.
"""
