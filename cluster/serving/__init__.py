"""Serving on Ray Serve: the deployment (deployment.py, built by app.build_app) answers the
warpspec.v1 gRPC API (grpc_service.py) and the OpenAI HTTP API (openai_api.py) over one replica's
engine (replica_frontend.py); request_mapping.py / openai_protocol.py translate messages, wire_errors.py
picks statuses, metrics.py exports Prometheus metrics, serve_cli.py is `warpspec serve`;
serve_internals.py holds the private Ray Serve APIs it relies on."""
