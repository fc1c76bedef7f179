"""The driver: the process that holds the user's training loop and drives the workers.

- `options`: the strategy's configuration as typed values, checked when built;
- `launch`: local ``lrmp-worker`` processes (the zero-config default);
- `workers`: where a run's workers come from: the hosts given, or local ones with fresh keys;
- `preflight`: what is checked of a spec before any worker is contacted;
- `links`: the links to a session's workers: connected, greeted, kept alive, closed;
- `session`: the session with the workers: plan and place modules, mirror optimizers, restore;
- `placement`: a placed module's state dict, kept truthful while its weights live on workers;
- `ties`: tied weights held by several stages, and which copy answers for them;
- `groups`: the process groups where workers sum gradients (replicas, tied weights), and their store;
- `pipeline`: the autograd front end that runs a placed module's micro-batches through its stages;
- `optim`: the optimizer mirror that steps the workers' share of the parameters.

No Lightning here: `lightning_remote_mp.lightning` is a thin layer on top. The driver never imports
the worker's modules; it starts workers as processes and talks to them over `lightning_remote_mp.wire`.
"""
