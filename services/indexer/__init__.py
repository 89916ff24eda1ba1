"""Hash-ingest KV-cache indexer: which worker already holds how much of a prompt.

Engines (or a relay in front of them) post Dynamo RouterEvents; gateways ask, for a prompt's
local block hashes, how many leading blocks each (worker, dp_rank) holds on the device tier and
how far host-pinned and disk copies extend that; for engines that publish nothing, gateways
report their routing decisions instead and the index approximates. Layout, as in Dynamo's
lib/kv-router: `protocols` (event model, parser, dump serializer), `tree` (one partition's
index), `approx` (approximations of routed prompts, with their TTLs) and `state` (partitions,
workers, event-id watermarks, query results), all free of I/O; `answers` shapes query results
into Dynamo's JSON answer for the HTTP shell (`app`).
"""
