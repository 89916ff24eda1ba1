"""The integer ranges of the wire formats, defined once.

Dynamo's services read ids and hashes as Rust integers: worker and instance ids as u64, DP ranks,
block sizes and token ids as u32, block hashes as i64 on the HTTP routes and u64 in KV events and
dumps. Every range check and every signed/unsigned conversion in the package uses these.
"""

from __future__ import annotations

from typing import Final

U32_MAX: Final = 2**32 - 1
"""Largest u32: DP ranks, block sizes, token ids."""
I64_MIN: Final = -(2**63)
"""Smallest i64, the lowest hash value the signed wire form (`/query_by_hash`, slot tracker) takes."""
I64_MAX: Final = 2**63 - 1
"""Largest i64: u64 hashes above it are negative in the signed wire form."""
U64_MAX: Final = 2**64 - 1
"""Largest u64: worker ids, and the highest hash value KV events and dumps carry."""
U64_MASK: Final = U64_MAX
"""64 one bits: `value & U64_MASK` is the u64 with the low 64 bits of `value`."""
U64_MODULUS: Final = 2**64
"""2**64: a negative i64 plus this is the u64 with the same bits."""
