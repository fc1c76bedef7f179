"""The model: what a user's network is to lrmp, before any socket is opened.

- `entries`: a layer spec's entries, read and normalised;
- `build`: classes resolved from dotted paths and layers built, under a worker's allowlist;
- `spec`: `SpecSequential`, the module a layer spec builds;
- `wiring`: residual variables: who produces and consumes each, and running layers under that convention;
- `graph`: traced programs as plain data, the operator allowlist, and `GraphLayer` that runs them;
- `export`: the ``torch.export`` front end: an unchanged ``nn.Module`` as an ATen graph;
- `trace`: that graph cut into units that workers run, and the stand-in for the module's ``forward``;
- `traced`: the traced module on the driver, and the map between its calls and the pipeline;
- `partition`: stages, the variables that cross them, and the balancing of layers over workers.

The model knows no sockets: it imports neither `lightning_remote_mp.wire` nor the layers above it.
"""
