"""httpx clients for the services: one method per route, typed results, typed errors.

`AsyncSlotTrackerClient` / `AsyncIndexerClient` / `AsyncSelectClient` are the clients a gateway
uses on its event loop; `SlotTrackerClient` / `IndexerClient` / `SelectClient` are the same
methods without `await`, for scripts and tests (they block: not for use on an event loop). Each
holds one pooled `httpx.AsyncClient` (or `httpx.Client`) with keep-alive and a timeout per call.

Every client takes the same keyword arguments: `timeout=` (seconds per call), `client=` (an
`httpx.AsyncClient` / `httpx.Client` to share; its base URL, timeout and TLS settings then
apply, and its owner closes it), `api_key=` (sent as `Authorization: Bearer KEY` to services
started with `--api-key`; default: `DYNAMO_LITE_API_KEY`, `""` sends none), for https:// URLs
`verify=` (True, a CA bundle path or an `ssl.SSLContext`) and `cert=` (a client certificate for
mutual TLS) as httpx takes them, or one `credentials=ClientCredentials(...)` for those three.
The async clients also take `lean=True`: the lean HTTP/1.1 transport (`dynamo_lite.client.lean_http`:
plain http only, a tenth of httpx's CPU per call, one call in flight per pooled connection).

Errors, like httpx's: every failed call raises a `ServiceCallError`, as one of

* `ServiceStatusError`: the service answered with an error status (`status`, and its
  `{"error": ...}` text as `message`);
* `TransportError`: no usable answer (`status` 0), more precisely `ConnectError` (no
  connection, the call was not sent), `CallTimeout` (no answer in time) or `InvalidAnswer` (an
  answer that does not read: not JSON, cut short, of another shape, or too large).

Answers are decoded into their types in one pass; a field a newer service adds is ignored, so a
service release never breaks a deployed client.

Code that catches `ServiceCallError` and reads `status` (0 for no answer) keeps working.

The public names are the ones in `__all__`, listed in the reference (docs/client-reference.md);
modules and names with a leading underscore are not (`_client_base`, `_async_client` and the
generated `_sync_client` hold the code). The answer rows of the slot tracker are the service's
own wire types (`dynamo_lite.slot_tracker.protocols`), re-exported here:

* `WorkerInfo`: one registered worker (`worker_id`, `model_name`, `tenant_id`, `block_size`,
  and its DP range `dp_start`, `dp_size`), as `workers()` lists them.
* `RankLoad`: one rank's current load (`active_prefill_tokens`, `active_decode_blocks`), as
  `loads()` lists them.
* `PotentialLoad`: one rank's load if a request were added there (`potential_prefill_tokens`,
  `potential_decode_blocks`, plus its `active_requests`), as `potential_loads()` lists them.

The indexer's answers are the client's own types: `IndexerWorker` and `IndexerRank`
(`workers()`), `OverlapScores` (`query_by_hash()`, `query()`), `IngestReport` (`events()`),
`RoutedReport` (`routed()`).

The selection service's too: `SelectedWorker` with its `Overlap` (`select()`,
`select_and_reserve()`), `Reservation` (`reserve()`), `WorkerRecord` (`upsert_worker()`,
`patch_worker()`, `delete_worker()`, `workers()`), `Readiness` (`ready()`), `PartitionLoads`
(`loads()`), `TieredOverlap` with its `RankOverlap` rows (`overlap_scores()`).
"""

from __future__ import annotations

from dynamo_lite.slot_tracker.protocols import PotentialLoad, RankLoad, WorkerInfo
from dynamo_lite.web.credentials import ClientCredentials

from ._async_client import AsyncIndexerClient, AsyncSelectClient, AsyncSlotTrackerClient
from ._client_base import (
    DEFAULT_TENANT,
    DEFAULT_TIMEOUT_SECS,
    CallTimeout,
    ConnectError,
    IndexerRank,
    IndexerWorker,
    IngestReport,
    InvalidAnswer,
    OverlapScores,
    RoutedReport,
    ServiceCallError,
    ServiceStatusError,
    TransportError,
)
from ._select_types import (
    Overlap,
    PartitionLoads,
    RankOverlap,
    Readiness,
    Reservation,
    SelectedWorker,
    TieredOverlap,
    WorkerRecord,
)
from ._sync_client import IndexerClient, SelectClient, SlotTrackerClient

__all__ = [
    "AsyncSlotTrackerClient",
    "AsyncIndexerClient",
    "AsyncSelectClient",
    "SlotTrackerClient",
    "IndexerClient",
    "SelectClient",
    "ServiceCallError",
    "ServiceStatusError",
    "TransportError",
    "ConnectError",
    "CallTimeout",
    "InvalidAnswer",
    "OverlapScores",
    "IndexerWorker",
    "IndexerRank",
    "IngestReport",
    "RoutedReport",
    "SelectedWorker",
    "Overlap",
    "Reservation",
    "WorkerRecord",
    "Readiness",
    "PartitionLoads",
    "TieredOverlap",
    "RankOverlap",
    "DEFAULT_TIMEOUT_SECS",
    "DEFAULT_TENANT",
    "ClientCredentials",
    "WorkerInfo",
    "RankLoad",
    "PotentialLoad",
]
