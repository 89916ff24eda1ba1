"""Our local block hashes against Dynamo 1.6.1's own binding, on random token lists."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
from support.reference_server import require_reference_or_skip

from dynamo_lite.hashing import local_block_hashes

pytestmark = [pytest.mark.process, pytest.mark.reference]

_REFERENCE_SCRIPT = """
import json, sys
from dynamo.llm import compute_block_hash_for_seq
cases = json.load(sys.stdin)
out = [compute_block_hash_for_seq(c["tokens"], c["block_size"], lora_name=c["lora_name"],
                                  cache_namespace=c["cache_salt"]) for c in cases]
json.dump(out, sys.stdout)
"""


def test_local_block_hashes_equal_dynamos_binding() -> None:
    python = require_reference_or_skip()
    rng = random.Random(1337)
    cases = []
    for _ in range(300):
        block_size = rng.choice([1, 4, 16, 32, 64])
        length = rng.randint(0, 6 * block_size + block_size - 1)
        tokens = [rng.choice([rng.randint(0, 255), rng.randint(0, 2**32 - 1)]) for _ in range(length)]
        cases.append({
            "tokens": tokens,
            "block_size": block_size,
            "lora_name": rng.choice([None, None, "my-lora", "adapter-é"]),
            "cache_salt": rng.choice([None, None, "tenant-a", "salt"]),
        })
    result = subprocess.run([str(python), "-c", _REFERENCE_SCRIPT], input=json.dumps(cases),
                            capture_output=True, text=True, timeout=120, check=True)
    expected = json.loads(result.stdout)
    for case, theirs in zip(cases, expected):
        ours = local_block_hashes(case["tokens"], case["block_size"], lora_name=case["lora_name"],
                                  cache_salt=case["cache_salt"])
        assert ours == theirs, case
