"""The name traced units travel under: ``lightning_remote_mp.graph.GraphLayer``.

A unit of a traced model reaches a worker as an ordinary spec entry whose layer is this dotted path,
so it is user vocabulary on the wire and in allowlists, like `lightning_remote_mp.layers`, and keeps
its name wherever the code lives: in `lightning_remote_mp.model.graph_layer`; the operator allowlist
it runs under is `lightning_remote_mp.model.program`.
"""

from lightning_remote_mp.model.graph_layer import GraphLayer

__all__ = ["GraphLayer"]
