"""The wire: what crosses a network between the driver and the workers, and how.

- `fields`: how a typed message declares its fields once;
- `protocol`: the frames (a msgpack header, one raw frame per tensor; no pickle), bundles and limits;
- `transport`: ZeroMQ sockets and deadlines (every socket lrmp opens is made there), a driver's `Connection`;
- `heartbeat`: the driver's background pings, which tell a lost worker from a busy one;
- `collect`: a pipeline's answers from several workers at once, and what counts as a stall;
- `keys`: CURVE key pairs and their files;
- `messages`: the pipeline's typed messages (a micro-batch's forward and backward);
- `requests`: the driver's other typed requests;
- `carry`: the driver's quiet requests carried along the pipeline, each sealed for its worker.

The wire knows no layers and no Lightning: it imports neither `lightning_remote_mp.model` nor the
layers above it.
"""
