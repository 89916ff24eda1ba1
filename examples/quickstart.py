"""Route one request with KvRouter: the Python example of the README and the docs, verbatim (a test checks)."""

import asyncio
import os

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient, ServiceCallError
from dynamo_lite.routing import KvRouter


async def main() -> None:
    async with AsyncSlotTrackerClient(os.environ.get("SLOT_TRACKER_URL", "http://localhost:8091")) as slot_tracker, \
            AsyncIndexerClient(os.environ.get("INDEXER_URL", "http://localhost:8090")) as indexer:
        # Two workers, one data-parallel rank each, known to both services. The ids and the
        # model are this example's own, so it runs next to the others on the same services.
        registered = []  # what the end unregisters, whatever happens: this example's, nothing else
        try:
            for worker_id in (51, 52):
                for service in (slot_tracker, indexer):
                    await service.register(worker_id, "quickstart", block_size=16)
                    registered.append((service, worker_id))

            # The default cost: each rank's predicted time to first token, plus what the request's
            # cache writes will cost later requests (docs/routing.md); RouterConfig() is Dynamo's.
            router = KvRouter(slot_tracker, indexer, block_size=16, seed=0)
            token_ids = list(range(1, 101))  # the prompt, tokenized: 6 full blocks of 16
            local, chained = router.hashes_for(token_ids)
            decision = await router.select("quickstart", isl_tokens=len(token_ids),
                                           local_hashes=local, sequence_hashes=chained)
            for cost in decision.costs:
                print(cost.formula())  # the cost breakdown per rank, in seconds
            print(f"chosen: worker {decision.worker_id}, rank {decision.dp_rank}")

            handle = await router.commit(decision, request_id="req-1")  # POST /add
            await handle.prefill_complete()                             # at the first output token
            await handle.free()                                         # at the end
        finally:
            for service, worker_id in reversed(registered):
                await service.unregister(worker_id, "quickstart")


try:
    asyncio.run(main())
except ServiceCallError as error:  # a refused connection, or a service refusing a call (409: ids in use)
    raise SystemExit(f"quickstart.py: {error}") from None
