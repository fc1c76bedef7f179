"""Lightning's side: the only layer that imports Lightning.

- `strategy`: `RemoteModelParallelStrategy`, Lightning's hooks and nothing else;
- `timeline`: the callback that writes the per-stage timeline;
- `summary`: the model summary with a column saying where each layer lives.

``lrmp-worker`` never imports this package, so a worker starts without Lightning.
"""
