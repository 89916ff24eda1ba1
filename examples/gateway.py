"""A minimal gateway loop: register a fleet, route a stream of prompts, report each request's
lifecycle, read the loads.

    .venv/bin/python examples/gateway.py --slot-tracker http://localhost:8091 --indexer http://localhost:8090

Its workers (61..64) and model (`gateway-example`) are its own, so it runs next to the other
examples and the simulator against the same services; `--first-worker-id` and `--model-name`
change them. It unregisters what it registered, and only that, whatever happens.

Three conversations of three turns each go to a fleet of four workers, one turn of each
conversation in flight at a time. Each turn's prompt repeats the conversation so far, so once a
worker has served a turn it holds that prefix and the router sends the next turn there (its
cost counts only the uncached blocks), while requests in flight make a busy worker cost more
for a new conversation. In production the engines tell the indexer what they cached (they publish KV events
that the indexer subscribes to); here each worker's stand-in engine reports it through the
sidecar of `examples/sidecar.py` when a request finishes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

from dynamo_lite.client import AsyncIndexerClient, AsyncSlotTrackerClient, ServiceStatusError, TransportError
from dynamo_lite.routing import KvRouter, NoWorkerAvailable, RequestHandle
from dynamo_lite.routing.scheduling import ttft_config
from dynamo_lite.web.cli import HelpFormatter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sidecar import EngineSidecar  # noqa: E402  (the example beside this one)

BLOCK_SIZE = 16
FLEET_SIZE = 4


async def route(router: KvRouter, model: str, request_id: str, tokens: list[int], session: str) -> RequestHandle:
    """Pick a worker for one request and book it there (POST /add). `session` names the
    conversation: the router keeps it where its cache is even while the times it learns from
    (here a stand-in's, on a busy machine) are noisy."""
    local, chained = router.hashes_for(tokens)
    decision = await router.select(model, isl_tokens=len(tokens), local_hashes=local, sequence_hashes=chained,
                                   session_id=session)
    chosen = decision.chosen
    print(f"{request_id}: {len(tokens)} tokens -> worker {decision.worker_id} "
          f"(cached {chosen.cached_tokens} tokens, cost {1000 * chosen.cost:.2f} ms; "
          f"lookup {decision.lookup_secs * 1000:.1f} ms)")
    return await router.commit(decision, request_id)  # the gateway forwards the request now


async def run(slot_tracker_url: str, indexer_url: str, model: str, first_worker_id: int) -> int:
    rng = random.Random(0)
    fleet = range(first_worker_id, first_worker_id + FLEET_SIZE)
    async with AsyncSlotTrackerClient(slot_tracker_url) as slot_tracker, AsyncIndexerClient(indexer_url) as indexer:
        registered = []  # (service, worker id): the clean-up leaves anyone else's workers alone
        try:
            for worker_id in fleet:
                for service in (slot_tracker, indexer):
                    await service.register(worker_id, model, BLOCK_SIZE)
                    registered.append((service, worker_id))
            engines = {worker_id: EngineSidecar(indexer, model, worker_id, block_size=BLOCK_SIZE)
                       for worker_id in fleet}
            # The default cost, with the engines' rates as configured rather than learned: these
            # stand-ins answer at once, so the delays the router would learn from are only this
            # machine's noise. Against real engines leave `learn_rates` on (the default).
            router = KvRouter(slot_tracker, indexer, block_size=BLOCK_SIZE, seed=0,
                              config=ttft_config(learn_rates=False))
            conversations: dict[str, list[int]] = {name: [] for name in ("a", "b", "c")}
            placed: dict[str, set[int]] = {name: set() for name in conversations}
            for turn in range(3):
                # One turn of every conversation is in flight at once.
                handles = {}
                for name, history in conversations.items():
                    history += [rng.randrange(32_000) for _ in range(64)]  # the user's next message
                    handles[name] = await route(router, model, f"{name}-{turn}", list(history), name)
                    await handles[name].prefill_complete()  # its engine streamed the first token
                if turn == 0:
                    for load in await slot_tracker.loads(model):
                        print(f"  worker {load.worker_id}: {load.active_decode_blocks} decode blocks, "
                              f"{load.active_prefill_tokens} prefill tokens active")
                for name, handle in handles.items():
                    engine = engines[handle.decision.worker_id]
                    await engine.publish(engine.stored(conversations[name]))  # its prompt blocks are cached
                    await handle.free()  # the response is complete
                    placed[name].add(handle.decision.worker_id)
            sticky = all(len(workers) == 1 for workers in placed.values())
            spread = len({next(iter(workers)) for workers in placed.values()}) == len(placed)
            print("every conversation stayed on one worker, each on its own" if sticky and spread
                  else f"placements: {placed}")
            return 0 if sticky and spread else 1
        except NoWorkerAvailable as error:
            print(f"cannot route: {error}", file=sys.stderr)
            return 2
        finally:
            for service, worker_id in reversed(registered):
                await service.unregister(worker_id, model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Route three conversations over four workers with KvRouter.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--slot-tracker", default=os.environ.get("SLOT_TRACKER_URL", "http://localhost:8091"),
                        help="the slot tracker's base URL [env SLOT_TRACKER_URL]")
    parser.add_argument("--indexer", default=os.environ.get("INDEXER_URL", "http://localhost:8090"),
                        help="the indexer's base URL [env INDEXER_URL]")
    parser.add_argument("--model-name", default="gateway-example", help="the model the fleet is registered under")
    parser.add_argument("--first-worker-id", type=int, default=61,
                        help=f"the fleet's worker ids are this and the next {FLEET_SIZE - 1}")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args.slot_tracker, args.indexer, args.model_name, args.first_worker_id))
    except TransportError as error:  # no answer: the service is down or the URL is wrong
        print(f"gateway.py: cannot reach a service: {error}", file=sys.stderr)
        return 1
    except ServiceStatusError as error:  # the service's answer to a call it refused (409: ids in use)
        print(f"gateway.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
