"""schemathesis hooks for the CLI runs over the served documents (tests/test_served_documents.py,
loaded through SCHEMATHESIS_HOOKS): what the Python-API runs do in `schema_support.load`."""

from __future__ import annotations

import schemathesis

from support.schema_support import has_integral_float


@schemathesis.hook
def filter_body(ctx: schemathesis.HookContext, body: object) -> bool:
    """JSON Schema calls 404.0 an integer; the services, like Dynamo's serde, answer 422 to any
    number written with a fraction or exponent (tested in the HTTP tests)."""
    return not has_integral_float(body)
