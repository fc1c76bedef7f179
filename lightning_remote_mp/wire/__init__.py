"""The wire: what crosses a network between the driver and the workers, and how.

- `protocol`: the frames (a msgpack header, one raw frame per tensor; no pickle), bundles and limits;
- `transport`: ZeroMQ sockets, deadlines and heartbeats (every socket lrmp opens is made there);
- `keys`: CURVE key pairs and their files;
- `messages`: the pipeline's typed messages (a micro-batch's forward and backward);
- `requests`: the driver's other typed requests.

The wire knows no layers and no Lightning: it imports neither `lightning_remote_mp.model` nor the
layers above it.
"""
