"""Standalone slot tracker: active-request load accounting for KV-aware routers.

`core` holds the accounting (pure, synchronous), `app` the HTTP shell, `snapshot` the state's
way out of the process and back (`/dump`, `--snapshot`, `--peers`), `replication` what replicas
tell each other and how a replica applies it (pure, synchronous), `nats_replica` the NATS side of
replicas (`--nats`), `__main__` the CLI.
"""
