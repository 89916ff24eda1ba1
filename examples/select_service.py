"""One call per request with the selection service: register two engines, let one cache a
prompt, and route the next turn of that conversation to it; then the booking's lifecycle.

    .venv/bin/python -m dynamo_lite.select_service &          # port 8092
    .venv/bin/python examples/select_service.py --select-service http://localhost:8092

The engines are two KV-event publishers of this process (`dynamo_lite.kv_publishers`, the bytes
vLLM publishes), so no engine needs to run; a real fleet registers its engines' own
`kv_events_endpoint`s. Its workers (71, 72) and model (`select-example`) are its own, and it
removes them at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dynamo_lite.client import SelectClient, ServiceCallError
from dynamo_lite.hashing import local_block_hashes, sequence_hashes
from dynamo_lite.kv_publishers import EnginePublisher, Stored, WireFormat
from dynamo_lite.web.cli import HelpFormatter

BLOCK_SIZE = 16


def run(url: str, model: str, first_worker_id: int) -> int:
    engines = [EnginePublisher(WireFormat.VLLM) for _ in range(2)]
    workers = [first_worker_id, first_worker_id + 1]
    registered: list[int] = []
    try:
        with SelectClient(url) as selector:
            for worker_id, engine in zip(workers, engines):
                record = selector.upsert_worker(worker_id, model_name=model, endpoint=f"http://engine-{worker_id}:8000",
                                                block_size=BLOCK_SIZE, kv_events_endpoint=engine.endpoint)
                registered.append(worker_id)
                print(f"worker {worker_id}: {record.lifecycle}")
                engine.wait_for_subscribers()
            # The second engine served the first turn (64 tokens): it caches its 4 blocks.
            first_turn = list(range(1000, 1064))
            chained = sequence_hashes(local_block_hashes(first_turn, BLOCK_SIZE))
            engines[1].publish([Stored(chained, None, first_turn, BLOCK_SIZE)])
            second_turn = first_turn + list(range(2000, 2040))
            deadline = time.monotonic() + 10
            while selector.overlap_scores(model, second_turn).workers[1].device_blocks < 4:
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine's KV events did not arrive in 10 s")
                time.sleep(0.05)
            pick = selector.select_and_reserve(model, second_turn, selection_id="select-example-turn-2")
            print(f"turn 2: {len(second_turn)} tokens -> worker {pick.worker_id} at {pick.endpoint} "
                  f"(cached {pick.overlap.gpu} tokens, {pick.effective_prefill_tokens} left to prefill)")
            selector.prefill_complete(pick.selection_id or "")
            for _ in range(3):
                selector.output_block(pick.selection_id or "")
            (partition,) = selector.loads(model)
            print("loads:", {row.worker_id: row.potential_decode_blocks for row in partition.loads})
            selector.free(pick.selection_id or "")
            return 0
    finally:
        try:
            with SelectClient(url) as selector:
                for worker_id in registered:
                    selector.delete_worker(worker_id)
        except ServiceCallError as exc:
            print(f"select_service.py: cleaning up: {exc}", file=sys.stderr)
        for engine in engines:
            engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Route a conversation's next turn with the selection service.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--select-service", default=os.environ.get("SELECT_SERVICE_URL", "http://localhost:8092"),
                        help="the selection service's base URL [env SELECT_SERVICE_URL]")
    parser.add_argument("--model-name", default="select-example", help="the model the example's workers serve")
    parser.add_argument("--first-worker-id", type=int, default=71, help="the example's two workers take this id and the next")
    args = parser.parse_args(argv)
    try:
        return run(args.select_service, args.model_name, args.first_worker_id)
    except (ServiceCallError, TimeoutError) as error:
        print(f"select_service.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
