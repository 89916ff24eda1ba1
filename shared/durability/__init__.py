"""A service's state beyond one process: snapshots on disk, recovery from peers and the
NATS connection replicas share.

Imports `dynamo_lite.base` and `dynamo_lite.web` only.
"""
