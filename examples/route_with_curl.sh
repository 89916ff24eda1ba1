#!/usr/bin/env bash
# One routing decision with nothing but curl (and bash arithmetic): what KvRouter does.
#
#   SLOT_TRACKER_URL=http://localhost:8091 INDEXER_URL=http://localhost:8090 bash examples/route_with_curl.sh
#
# Worker 41 already holds the first 4 blocks of the prompt (tokens 1..64, block size 16), worker
# 42 nothing; worker 41 also has a request in flight. The prompt is tokens 1..96 (6 blocks).
# cost = overlap_score_weight * prefill_blocks + decode_blocks, the lowest wins.
# The workers and the model (curl-example) are this example's own, so it runs next to the other
# examples and the simulator against the same services. Services started with --api-key: set
# DYNAMO_LITE_API_KEY too (sent as `Authorization: Bearer`).
set -euo pipefail
B=${SLOT_TRACKER_URL:-http://localhost:8091}
I=${INDEXER_URL:-http://localhost:8090}
J='Content-Type: application/json'
MODEL=curl-example
AUTH=()
if [[ -n "${DYNAMO_LITE_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${DYNAMO_LITE_API_KEY%%,*}"); fi
# POST $1 with body $2; print the answer. A refusal ends the script with the service's own
# message on one line (curl's "(22) ... 409" says nothing of why); curl's own line says why a
# connection failed.
post() {
  local answer status
  answer=$(curl -sS "${AUTH[@]}" -X POST "$1" -H "$J" -d "$2" -w $'\n%{http_code}') || exit 1
  status=${answer##*$'\n'}
  answer=${answer%$'\n'*}
  if [ "$status" -ge 300 ]; then
    echo "route_with_curl.sh: POST $1 answered $status $answer" >&2
    exit 1
  fi
  printf '%s' "$answer"
}
created=()  # what this run registered and added, undone in reverse by the exit trap (nothing else)
cleanup() {
  local index
  for (( index=${#created[@]} - 1; index >= 0; index-- )); do
    curl -sS "${AUTH[@]}" -X POST ${created[index]} -H "$J" >/dev/null || true
  done
}
trap cleanup EXIT

# The prompt's hashes, as dynamo_lite.hashing computes them from token ids 1..96 (signed i64):
# local block hashes for the indexer, chained sequence hashes for the slot tracker.
LOCAL='[-1583300653928780152,2287610619914608821,-6316808760778579817,5453111288643762282,-1611788688006278862,72652856785317591]'
CHAINED='[-1583300653928780152,-5980354406663771828,960926348267535642,4923844688253642376,2331915526079212067,6591812828282533523]'
ISL=96; BLOCK=16; WEIGHT=1

# 1. Register both workers with both services.
for worker in 41 42; do
  post "$B/register" "{\"model_name\":\"$MODEL\",\"worker_id\":$worker,\"block_size\":$BLOCK,\"dp_start\":0,\"dp_size\":1}" >/dev/null
  created+=("$B/unregister -d {\"model_name\":\"$MODEL\",\"worker_id\":$worker}")
  post "$I/register" "{\"model_name\":\"$MODEL\",\"instance_id\":$worker,\"block_size\":$BLOCK}" >/dev/null
  created+=("$I/unregister -d {\"model_name\":\"$MODEL\",\"instance_id\":$worker}")
done

# 2. Worker 41's engine reported the first 4 blocks (its own block ids 161..164), and it serves
#    another request (2 blocks, all prefilled).
post "$I/events" '{"curl-example:default": {"block_size": 16, "events": [{"worker_id": 41, "event": {"event_id": 0,
  "data": {"stored": {"parent_hash": null, "blocks": [
    {"block_hash": 161, "tokens_hash": 16863443419780771464}, {"block_hash": 162, "tokens_hash": 2287610619914608821},
    {"block_hash": 163, "tokens_hash": 12129935312930971799}, {"block_hash": 164, "tokens_hash": 5453111288643762282}]}}}}]}}' >/dev/null
post "$B/add" '{"model_name":"curl-example","request_id":"other","worker_id":41,"dp_rank":0,"sequence_hashes":[1,2],"new_isl_tokens":32}' >/dev/null
created+=("$B/free -d {\"model_name\":\"$MODEL\",\"request_id\":\"other\"}")
post "$B/prefill_complete" '{"model_name":"curl-example","request_id":"other"}' >/dev/null

# 3. The two reads a gateway makes per request (in parallel in a real gateway).
overlap=$(post "$I/query_by_hash" "{\"model_name\":\"$MODEL\",\"block_hashes\":$LOCAL}")
loads=$(post "$B/potential_loads" "{\"model_name\":\"$MODEL\",\"sequence_hashes\":$CHAINED,\"new_isl_tokens\":0}")
echo "query_by_hash:   $overlap"
echo "potential_loads: $loads"

# 4. Cost per worker (integers, in thousandths of a block).
best=""; best_cost=""
for worker in 41 42; do
  cached=$(grep -o "\"$worker\":{\"0\":[0-9]*}" <<<"$overlap" | grep -o '[0-9]*}$' | tr -d '}' || true)
  cached=${cached:-0}
  row=$(grep -o "{\"worker_id\":$worker,[^}]*}" <<<"$loads")
  prefill=$(grep -o '"potential_prefill_tokens":[0-9]*' <<<"$row" | cut -d: -f2)
  decode=$(grep -o '"potential_decode_blocks":[0-9]*' <<<"$row" | cut -d: -f2)
  # prefill_blocks = (active prefill + prompt - cached) / block size; decode blocks as projected.
  cost=$(( WEIGHT * (prefill + ISL - cached) * 1000 / BLOCK + decode * 1000 ))
  echo "worker $worker: cached $cached tokens, cost = $WEIGHT * ($prefill + $ISL - $cached) / $BLOCK + $decode = $((cost / 1000)).$(printf '%03d' $((cost % 1000)))"
  if [ -z "$best" ] || [ "$cost" -lt "$best_cost" ]; then best=$worker; best_cost=$cost; fi
done
echo "chosen: worker $best"

# 5. Book it, then report the lifecycle: the first token, each output block filled (16 tokens
#    generated: one), the end. Output blocks are a total and free is idempotent: retries are harmless.
cached=$(grep -o "\"$best\":{\"0\":[0-9]*}" <<<"$overlap" | grep -o '[0-9]*}$' | tr -d '}' || true)
post "$B/add" "{\"model_name\":\"$MODEL\",\"request_id\":\"req-1\",\"worker_id\":$best,\"dp_rank\":0,\"sequence_hashes\":$CHAINED,\"new_isl_tokens\":$(( ISL - ${cached:-0} ))}" >/dev/null
created+=("$B/free -d {\"model_name\":\"$MODEL\",\"request_id\":\"req-1\"}")
post "$B/prefill_complete" '{"model_name":"curl-example","request_id":"req-1"}' >/dev/null
post "$B/output_blocks" '{"model_name":"curl-example","request_id":"req-1","output_blocks":1}' >/dev/null
echo "loads: $(curl -sS "${AUTH[@]}" "$B/loads?model_name=$MODEL")"
post "$B/free" '{"model_name":"curl-example","request_id":"req-1"}' >/dev/null
# 6. The exit trap frees the other request and unregisters both workers: what this run created.
