"""The model: what a user's network is to lrmp, before any socket is opened.

- `spec`: layer specs, class resolution under an allowlist, residual-variable wiring, `SpecSequential`;
- `graph`: traced programs as plain data, the operator allowlist, and `GraphLayer` that runs them;
- `trace`: the ``torch.export`` front end that cuts an unchanged ``nn.Module`` into units;
- `partition`: stages, the variables that cross them, and the balancing of layers over workers.

The model knows no sockets: it imports neither `lightning_remote_mp.wire` nor the layers above it.
"""
