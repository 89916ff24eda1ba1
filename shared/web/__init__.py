"""The HTTP service framework: server, routes (`http`), request types (`validation`),
API keys, TLS, access logs, metrics and the services' shared command line (`cli`).

Imports only `dynamo_lite.base`.
"""
