"""The loraserve.v1 gRPC contract: ``.proto`` sources in ``protos/v1`` and the modules generated from them.

The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` / ``*_pb2.pyi`` files are build outputs (``make protos``
or ``python -m loraserve.protos.build``) and are never edited by hand.
"""
