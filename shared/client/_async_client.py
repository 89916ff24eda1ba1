"""The async clients' route methods: the one source of both clients' methods.

`scripts/generate_sync_client.py` writes `_sync_client.py` from this file (`async def` becomes
`def`, `await` goes, `Async` leaves the names); `tests/test_client.py` fails when that file is
stale. Edit here, then run the script.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from dynamo_lite.slot_tracker.protocols import PotentialLoad, RankLoad, WorkerInfo

from ._client_base import (
    DEFAULT_TENANT,
    DOCUMENT,
    INDEXER_WORKERS,
    INGEST_REPORT,
    LOADS,
    OVERLAP,
    POTENTIAL_LOADS,
    ROUTED_REPORT,
    URLS,
    WORKERS,
    IndexerWorker,
    IngestReport,
    OverlapScores,
    RoutedReport,
    ServiceStatusError,
    _AsyncServiceClient,
    filters,
)
from ._select_types import (
    PARTITION_LOADS,
    READINESS,
    RESERVATION,
    SELECT_POTENTIAL_LOADS,
    SELECTED,
    TIERED_OVERLAP,
    WORKER_RECORD,
    WORKER_RECORDS,
    PartitionLoads,
    Readiness,
    Reservation,
    SelectedWorker,
    TieredOverlap,
    WorkerRecord,
    decode_readiness,
    prompt_body,
    select_filters,
    worker_fields,
)


class AsyncSlotTrackerClient(_AsyncServiceClient):
    """Client of the slot tracker (active requests and load per rank): one method per route.

    Use it as `async with AsyncSlotTrackerClient(url) as tracker:`, or call `aclose()` at the
    end. Without a `base_url` it calls `DEFAULT_URL`; the constructor's other arguments are the
    same for every client (see `dynamo_lite.client`).
    """

    DEFAULT_URL = "http://127.0.0.1:8091"

    async def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_start: int = 0,
        dp_size: int = 1,
        tenant_id: str = DEFAULT_TENANT,
        role: str = "aggregated",
    ) -> None:
        """Register a worker with the DP ranks `dp_start` .. `dp_start + dp_size - 1`.

        The first worker of a (model, tenant) fixes its `block_size`; 409 if the worker is
        already registered or the block size differs. A `role` of `"prefill"` tracks only its
        requests' prefill tokens (no active or output blocks); `"decode"` and `"aggregated"`
        track everything.
        """
        body: dict[str, Any] = {
            "worker_id": worker_id, "model_name": model_name, "tenant_id": tenant_id,
            "block_size": block_size, "dp_start": dp_start, "dp_size": dp_size,
        }
        if role != "aggregated":  # Dynamo's slot tracker takes no role
            body["role"] = role
        await self._transport.call("POST", "/register", body)

    async def unregister(self, worker_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """Remove a worker with its ranks and their active requests; 404 if it is not registered."""
        await self._transport.call(
            "POST", "/unregister", {"worker_id": worker_id, "model_name": model_name, "tenant_id": tenant_id}
        )

    async def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[WorkerInfo]:
        """The registered workers, optionally of one model and/or tenant only."""
        workers: list[WorkerInfo] = await self._transport.call("GET", "/workers", params=filters(model_name, tenant_id),
                                                               answer=WORKERS)
        return workers

    async def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
        expected_output_tokens: int | None = None,
    ) -> None:
        """Book a request on a rank: its prompt's chained `sequence_hashes` and the
        `new_isl_tokens` still to prefill count in that rank's load until `free()`. With
        `expected_output_tokens` (the answer's expected length, `nvext.agent_hints.osl`) its
        output blocks weigh less as the answer nears that length.

        404 if the model or the rank is unknown (the worker left: route again), 409 if the
        request id is already active.
        """
        body: dict[str, Any] = {
            "model_name": model_name, "tenant_id": tenant_id, "request_id": request_id,
            "worker_id": worker_id, "dp_rank": dp_rank, "sequence_hashes": list(sequence_hashes),
            "new_isl_tokens": new_isl_tokens,
        }
        if expected_output_tokens is not None:
            body["expected_output_tokens"] = expected_output_tokens
        await self._transport.call("POST", "/add", body)

    async def prefill_complete(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """The request produced its first token: its prompt tokens stop counting as prefill load."""
        await self._transport.call(
            "POST", "/prefill_complete", {"model_name": model_name, "tenant_id": tenant_id, "request_id": request_id}
        )

    async def output_blocks(
        self, model_name: str, request_id: str, output_blocks: int, *, tenant_id: str = DEFAULT_TENANT
    ) -> None:
        """The request has generated `output_blocks` full blocks so far (send it every `block_size`
        tokens): they count in its rank's decode blocks until `free()`.

        An absolute count, so a retry is harmless; 409 if it is smaller than the last one sent,
        404 if the request is not active (freed, expired, or its worker left).
        """
        await self._transport.call("POST", "/output_blocks", {
            "model_name": model_name, "tenant_id": tenant_id, "request_id": request_id,
            "output_blocks": output_blocks,
        })

    async def free(self, model_name: str, request_id: str, *, tenant_id: str = DEFAULT_TENANT) -> None:
        """The request ended: drop it from its rank's load. Idempotent, so safe to retry."""
        await self._transport.call(
            "POST", "/free", {"model_name": model_name, "tenant_id": tenant_id, "request_id": request_id}
        )

    async def loads(self, model_name: str | None = None, tenant_id: str | None = None) -> list[RankLoad]:
        """Current load of every rank (idle ones too), optionally of one model and/or tenant."""
        loads: list[RankLoad] = await self._transport.call("GET", "/loads", params=filters(model_name, tenant_id),
                                                           answer=LOADS)
        return loads

    async def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Sequence[int],
        new_isl_tokens: int = 0,
        *,
        tenant_id: str = DEFAULT_TENANT,
    ) -> list[PotentialLoad]:
        """Each rank's load if this request were added there, without booking it.

        With `new_isl_tokens=0`, `potential_prefill_tokens` is the rank's active prefill, as
        `KvRouter` asks. 404 if no worker of the model is registered.
        """
        loads: list[PotentialLoad] = await self._transport.call("POST", "/potential_loads", {
            "model_name": model_name, "tenant_id": tenant_id,
            "sequence_hashes": list(sequence_hashes), "new_isl_tokens": new_isl_tokens,
        }, answer=POTENTIAL_LOADS)
        return loads

    async def dump(self) -> dict[str, Any]:
        """The whole state as a versioned document: every partition's workers and active requests
        with the TTL each has left, what `--snapshot` files hold and `--peers` start-up loads."""
        document: dict[str, Any] = await self._transport.call("GET", "/dump", answer=DOCUMENT)
        return document


class AsyncIndexerClient(_AsyncServiceClient):
    """Client of the KV-cache indexer (which blocks each rank holds): one method per route.

    Use it as `async with AsyncIndexerClient(url) as indexer:`, or call `aclose()` at the end.
    Without a `base_url` it calls `DEFAULT_URL`; the constructor's other arguments are the same
    for every client (see `dynamo_lite.client`).
    """

    DEFAULT_URL = "http://127.0.0.1:8090"

    async def register(
        self,
        instance_id: int,
        model_name: str,
        block_size: int,
        *,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        endpoint: str | None = None,
        replay_endpoint: str | None = None,
    ) -> None:
        """Register one rank; with `endpoint` (the engine's ZMQ KV-event publisher) the indexer
        subscribes to it, and asks `replay_endpoint` for batches it missed."""
        body: dict[str, Any] = {
            "instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id,
            "block_size": block_size, "dp_rank": dp_rank,
        }
        if endpoint is not None:
            body["endpoint"] = endpoint
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        await self._transport.call("POST", "/register", body)

    async def unregister(
        self, instance_id: int, model_name: str, *, tenant_id: str = DEFAULT_TENANT, dp_rank: int | None = None
    ) -> None:
        """Remove one rank, or every rank of the instance when `dp_rank` is None, with their blocks."""
        body: dict[str, Any] = {"instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id}
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        await self._transport.call("POST", "/unregister", body)

    async def workers(self, model_name: str | None = None, tenant_id: str | None = None) -> list[IndexerWorker]:
        """The known instances with, per rank, how it is indexed, its block counts and event watermark."""
        instances: list[IndexerWorker] = await self._transport.call(
            "GET", "/workers", params=filters(model_name, tenant_id), answer=INDEXER_WORKERS)
        return instances

    async def events(self, document: dict[str, Any]) -> IngestReport:
        """Post a `/dump`-shaped document of RouterEvents; returns the ingest report."""
        report: IngestReport = await self._transport.call("POST", "/events", document, answer=INGEST_REPORT)
        return report

    async def query_by_hash(
        self, model_name: str, block_hashes: Sequence[int], *, tenant_id: str = DEFAULT_TENANT
    ) -> OverlapScores:
        """Cached tokens per rank for a prompt given as its local block hashes (signed i64).

        404 if nothing is registered or cached for the model yet.
        """
        scores: OverlapScores = await self._transport.call("POST", "/query_by_hash", {
            "model_name": model_name, "tenant_id": tenant_id, "block_hashes": list(block_hashes),
        }, answer=OVERLAP)
        return scores

    async def query(
        self,
        model_name: str,
        token_ids: Sequence[int],
        *,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> OverlapScores:
        """`query_by_hash` for a prompt given as token ids: the indexer hashes its full blocks."""
        body: dict[str, Any] = {"model_name": model_name, "tenant_id": tenant_id, "token_ids": list(token_ids)}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        scores: OverlapScores = await self._transport.call("POST", "/query", body, answer=OVERLAP)
        return scores

    async def routed(
        self,
        instance_id: int,
        model_name: str,
        block_hashes: Sequence[int] | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        dp_rank: int = 0,
        tenant_id: str = DEFAULT_TENANT,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RoutedReport:
        """Record that a prompt was routed to this rank (approximate indexing, for engines that
        publish no KV events): its blocks count for the rank for the indexer's TTL. Give the
        prompt as local block hashes (signed i64, as for `query_by_hash`) or as `token_ids`
        (with `lora_name` / `cache_salt`), exactly one of the two. Returns what it recorded;
        404 if the partition is unknown."""
        body: dict[str, Any] = {
            "instance_id": instance_id, "model_name": model_name, "tenant_id": tenant_id, "dp_rank": dp_rank,
        }
        if block_hashes is not None:
            body["block_hashes"] = list(block_hashes)
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        report: RoutedReport = await self._transport.call("POST", "/routed", body, answer=ROUTED_REPORT)
        return report

    async def dump(self) -> dict[str, Any]:
        """The whole index as an events document, which `events()` on another indexer ingests."""
        document: dict[str, Any] = await self._transport.call("GET", "/dump", answer=DOCUMENT)
        return document

    async def peers(self) -> list[str]:
        """The base URLs of the peer indexers this indexer knows (`--peers`, `register_peer`)."""
        urls: list[str] = await self._transport.call("GET", "/peers", answer=URLS)
        return urls

    async def register_peer(self, url: str) -> None:
        """Add a peer indexer's base URL to the list `peers()` returns."""
        await self._transport.call("POST", "/register_peer", {"url": url})

    async def deregister_peer(self, url: str) -> None:
        """Remove a peer indexer's base URL; 404 if it is not in the list."""
        await self._transport.call("POST", "/deregister_peer", {"url": url})


class AsyncSelectClient(_AsyncServiceClient):
    """Client of the selection service (one call per request picks and books a worker): one
    method per route.

    Use it as `async with AsyncSelectClient(url) as selector:`, or call `aclose()` at the end.
    Without a `base_url` it calls `DEFAULT_URL`; the constructor's other arguments are the same
    for every client (see `dynamo_lite.client`). A prompt is `token_ids`, or its hash form
    (`block_hashes`, `sequence_hashes` and `isl_tokens` together).
    """

    DEFAULT_URL = "http://127.0.0.1:8092"

    async def upsert_worker(
        self,
        worker_id: int,
        *,
        model_name: str = DEFAULT_TENANT,
        routing_group: str = DEFAULT_TENANT,
        endpoint: str | None = None,
        block_size: int | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_endpoints: dict[int, str] | None = None,
        replay_endpoint: str | None = None,
        data_parallel_start_rank: int | None = None,
        data_parallel_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        total_kv_blocks: int | None = None,
        **fields: Any,
    ) -> WorkerRecord:
        """Register a worker, or replace its record. The record answered says whether it is
        `schedulable`, or why not (`not_schedulable_reasons`); `fields` are the record's other
        fields (`taints`, `is_eagle`, ...)."""
        body: dict[str, Any] = {"worker_id": worker_id, "model_name": model_name, "routing_group": routing_group,
                                **worker_fields(endpoint, block_size, kv_events_endpoint, kv_events_endpoints,
                                                replay_endpoint, data_parallel_start_rank, data_parallel_size,
                                                max_num_batched_tokens, total_kv_blocks), **fields}
        record: WorkerRecord = await self._transport.call("POST", "/workers", body, answer=WORKER_RECORD)
        return record

    async def patch_worker(self, worker_id: int, **fields: Any) -> WorkerRecord:
        """Change the fields given (`endpoint=...`, `data_parallel_size=...`); the others stay."""
        if isinstance(fields.get("kv_events_endpoints"), dict):
            fields["kv_events_endpoints"] = {str(rank): url for rank, url in fields["kv_events_endpoints"].items()}
        record: WorkerRecord = await self._transport.call("PATCH", f"/workers/{worker_id}", fields,
                                                          answer=WORKER_RECORD)
        return record

    async def delete_worker(self, worker_id: int) -> WorkerRecord:
        """Remove a worker with its subscriptions, cached blocks and bookings; 404 if unknown."""
        record: WorkerRecord = await self._transport.call("DELETE", f"/workers/{worker_id}", answer=WORKER_RECORD)
        return record

    async def workers(self, model_name: str | None = None, routing_group: str | None = None) -> list[WorkerRecord]:
        """The catalog, sorted by (model_name, routing_group, worker_id)."""
        records: list[WorkerRecord] = await self._transport.call(
            "GET", "/workers", params=select_filters(model_name, routing_group), answer=WORKER_RECORDS)
        return records

    async def ready(self) -> Readiness:
        """Whether a worker can be selected, with the catalog (the service's 503 is an answer here)."""
        try:
            readiness: Readiness = await self._transport.call("GET", "/ready", answer=READINESS)
        except ServiceStatusError as exc:
            answered = decode_readiness(exc.message) if exc.status == 503 else None
            if answered is None:
                raise
            return answered
        return readiness

    async def select(
        self,
        model_name: str,
        token_ids: Sequence[int] | None = None,
        *,
        routing_group: str = DEFAULT_TENANT,
        selection_id: str | None = None,
        block_hashes: Sequence[int] | None = None,
        sequence_hashes: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        router_config_override: dict[str, Any] | None = None,
        **fields: Any,
    ) -> SelectedWorker:
        """The best worker for the prompt, nothing booked. With `selection_id`, the choice is
        kept for `reserve(selection_id)` to book. `fields`: the request's other fields
        (`session_id`, `allowed_worker_ids`, `pinned_worker`, `expected_output_tokens`,
        `advisory`, ...)."""
        body = prompt_body(model_name, routing_group, token_ids, block_hashes, sequence_hashes, isl_tokens,
                           lora_name, cache_salt, router_config_override)
        if selection_id is not None:
            body["selection_id"] = selection_id
        selected: SelectedWorker = await self._transport.call("POST", "/select", {**body, **fields}, answer=SELECTED)
        return selected

    async def select_and_reserve(
        self,
        model_name: str,
        token_ids: Sequence[int] | None = None,
        *,
        routing_group: str = DEFAULT_TENANT,
        selection_id: str | None = None,
        block_hashes: Sequence[int] | None = None,
        sequence_hashes: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        router_config_override: dict[str, Any] | None = None,
        **fields: Any,
    ) -> SelectedWorker:
        """The best worker for the prompt, booked under `selection_id` (a new UUID when None:
        read it from the answer). Call `prefill_complete`, `output_block` and `free` with it as
        the request goes on."""
        body = prompt_body(model_name, routing_group, token_ids, block_hashes, sequence_hashes, isl_tokens,
                           lora_name, cache_salt, router_config_override)
        if selection_id is not None:
            body["selection_id"] = selection_id
        selected: SelectedWorker = await self._transport.call("POST", "/select_and_reserve", {**body, **fields},
                                                              answer=SELECTED)
        return selected

    async def reserve(
        self,
        selection_id: str,
        *,
        model_name: str = DEFAULT_TENANT,
        routing_group: str = DEFAULT_TENANT,
        worker_id: int | None = None,
        dp_rank: int = 0,
        token_ids: Sequence[int] | None = None,
        sequence_hashes: Sequence[int] | None = None,
        isl_tokens: int | None = None,
        effective_prefill_tokens: int | None = None,
        **fields: Any,
    ) -> Reservation:
        """Without `worker_id`: book what `select(..., selection_id=...)` chose (once). With it:
        book the prompt on that worker and rank (as prefill only `effective_prefill_tokens`)."""
        body = prompt_body(model_name, routing_group, token_ids, None, sequence_hashes, isl_tokens, None, None, None)
        body["selection_id"] = selection_id
        if worker_id is not None:
            body["worker_id"] = worker_id
            body["dp_rank"] = dp_rank
        if effective_prefill_tokens is not None:
            body["effective_prefill_tokens"] = effective_prefill_tokens
        reservation: Reservation = await self._transport.call("POST", "/reservations", {**body, **fields},
                                                              answer=RESERVATION)
        return reservation

    async def prefill_complete(self, selection_id: str) -> None:
        """The booking's first token came: its prompt stops counting as prefill load."""
        await self._transport.call("POST", f"/reservations/{quote(selection_id, safe='')}/prefill_complete")

    async def output_block(self, selection_id: str, decay_fraction: float | None = None) -> None:
        """One more output block; with `decay_fraction`, every output block weighs that much from now on."""
        body = {} if decay_fraction is None else {"decay_fraction": decay_fraction}
        await self._transport.call("POST", f"/reservations/{quote(selection_id, safe='')}/output_block", body)

    async def free(self, selection_id: str) -> None:
        """The request ended: its load is released; 404 if the booking is unknown (or freed)."""
        await self._transport.call("DELETE", f"/reservations/{quote(selection_id, safe='')}")

    async def loads(self, model_name: str | None = None, routing_group: str | None = None) -> list[PartitionLoads]:
        """Every schedulable rank's booked load, per partition."""
        partitions: list[PartitionLoads] = await self._transport.call(
            "GET", "/loads", params=select_filters(model_name, routing_group), answer=PARTITION_LOADS)
        return partitions

    async def potential_loads(
        self, model_name: str, token_ids: Sequence[int] | None = None, *, routing_group: str = DEFAULT_TENANT,
        **fields: Any,
    ) -> list[PotentialLoad]:
        """Every schedulable rank's load with the prompt added there (prefill left and blocks)."""
        body = prompt_body(model_name, routing_group, token_ids, None, None, None, None, None, None)
        rows: list[PotentialLoad] = await self._transport.call("POST", "/potential_loads", {**body, **fields},
                                                               answer=SELECT_POTENTIAL_LOADS)
        return rows

    async def overlap_scores(
        self, model_name: str, token_ids: Sequence[int] | None = None, *, routing_group: str = DEFAULT_TENANT,
        **fields: Any,
    ) -> TieredOverlap:
        """The prompt's cached blocks on every schedulable rank, per tier."""
        body = prompt_body(model_name, routing_group, token_ids, None, None, None, None, None, None)
        overlap: TieredOverlap = await self._transport.call("POST", "/overlap_scores", {**body, **fields},
                                                            answer=TIERED_OVERLAP)
        return overlap

    async def dump(self) -> dict[str, Any]:
        """The index as an events document (what another selection service's `--indexer-peers` loads)."""
        document: dict[str, Any] = await self._transport.call("GET", "/dump", answer=DOCUMENT)
        return document
