"""What the tests share and test nowhere themselves: checkpoints written by transformers (hf_checkpoints,
eagle3_checkpoints, fp8_checkpoints), the session's Ray cluster (ray_cluster) and the scripts that start
clusters of their own (private_cluster), bounded waits (waiting), rank processes, hand-built steps, and
the clients a test drives (grpc_stream, agent_loop). The test folders mirror the source; this one does not.
"""
