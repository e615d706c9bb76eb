"""Generated protobuf / gRPC stubs for the ``tandem.v1`` protos. Do not edit.

Regenerate with ``python protos/codegen.py``; ``python protos/codegen.py --check`` fails when these
files are stale. Sources: ``protos/tandem/v1/*.proto``.
"""
