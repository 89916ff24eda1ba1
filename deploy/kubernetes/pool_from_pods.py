#!/usr/bin/env python3
"""The endpoint picker's pool file from the engine pods Kubernetes runs (standard library only).

The picker reads its endpoints from a file (deploy/kubernetes/epp.yaml mounts it from the
ConfigMap `dynamo-lite-epp-pool`), not from the InferencePool's selector. This turns
`kubectl get pods -o json` of the InferencePool's pods into that file, one endpoint per pod
(per data-parallel rank with --data-parallel-size), so the two stay in step:

    kubectl get pods -l app.kubernetes.io/name=mock-engine -o json \\
      | python3 deploy/kubernetes/pool_from_pods.py --model mock --block-size 16 \\
      | kubectl create configmap dynamo-lite-epp-pool --from-file=pool.yaml=/dev/stdin \\
          --dry-run=client -o yaml | kubectl apply -f -

Run it whenever the engine pods change (after a rollout or a scale, from a loop or a CronJob
with RBAC to list pods and update the ConfigMap). The kubelet refreshes the mounted file within
about a minute; the picker notices the change, unregisters the pods that left and registers the
new ones with the slot tracker and the indexer.

Each endpoint: `address` is the pod IP and the engine's HTTP port (the InferencePool's
targetPorts number: what the gateway connects to), `worker_id` a number derived from the pod's
UID (stable for the pod's life, never reused by another pod), the KV events at
tcp://<pod IP>:5557 and replay :5558 (vLLM's --kv-events-config endpoints; rank r of a
data-parallel engine publishes on both ports + r). Pods that are not Running, have no IP yet or
are being deleted are left out.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any


def worker_id(pod: dict[str, Any]) -> int:
    """53 bits of the pod's UID: unique per pod, and exact in any JSON reader."""
    return uuid.UUID(pod["metadata"]["uid"]).int >> (128 - 53)


def host(ip: str) -> str:
    return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip


def endpoints(pods: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for pod in sorted(pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])):
        status = pod.get("status", {})
        if status.get("phase") != "Running" or not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
            continue
        ip = host(status["podIP"])
        for rank in range(args.data_parallel_size):
            entry: dict[str, Any] = {
                "address": f"{ip}:{args.port}",
                "worker_id": worker_id(pod),
                "dp_rank": rank,
                "model": args.model,
                "block_size": args.block_size,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            }
            if args.kv_events_port:
                entry["kv_events_endpoint"] = f"tcp://{ip}:{args.kv_events_port + rank}"
                if args.replay_port:
                    entry["replay_endpoint"] = f"tcp://{ip}:{args.replay_port + rank}"
            if args.lora_names:
                entry["lora_names"] = list(args.lora_names)
            out.append(entry)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Read `kubectl get pods -o json` on stdin, write the endpoint picker's pool (JSON) on stdout.",
    )
    parser.add_argument("--model", required=True, help="the engines' served model name")
    parser.add_argument("--block-size", type=int, required=True, help="the engines' KV block size")
    parser.add_argument("--port", type=int, default=8000, help="the engines' HTTP port (the InferencePool's targetPorts)")
    parser.add_argument("--kv-events-port", type=int, default=5557, help="KV events PUB port; 0: none")
    parser.add_argument("--replay-port", type=int, default=5558, help="KV events replay port; 0: none")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--data-parallel-size", type=int, default=1, help="ranks per engine pod")
    parser.add_argument("--lora-names", nargs="*", default=[], help="LoRA adapters the engines serve")
    args = parser.parse_args(argv)
    document = json.load(sys.stdin)
    pods = document["items"] if document.get("kind") == "List" or "items" in document else [document]
    json.dump({"endpoints": endpoints(pods, args)}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
