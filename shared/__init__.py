"""dynamo_lite: standalone KV-router services (slot tracker and KV indexer) for LLM gateways."""

__version__ = "0.1.0"
