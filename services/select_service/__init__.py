"""Worker selection in one call per request, compatible with Dynamo 1.6.1's
`python -m dynamo.select_service`: a worker catalog (each worker's KV events subscribed to
here), `/select` and `/select_and_reserve`, and the reservation lifecycle, on the cores of the
slot tracker and the indexer and the scheduling cycle of `dynamo_lite.routing.scheduling`, in one
process (docs/select-service.md)."""
