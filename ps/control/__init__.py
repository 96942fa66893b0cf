"""The gRPC control plane of the parameter server: status, checkpoint, pause, resume, shutdown.

``control.proto`` is the API; ``control_pb2*.py`` are generated from it by ``tools/gen_proto.sh``
and must not be edited by hand. ``control_service.py`` serves the API, ``auth.py`` checks bearer tokens,
``hooks.py`` is the seam to the checkpointer. Nothing here touches parameters or gradients.
"""
