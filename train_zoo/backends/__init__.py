"""Where training runs. Every backend has ``run(spec, indices, engine) -> Iterator[result]``:
it trains the given checkpoint indices and yields each :class:`CheckpointResult` as soon as
it is done, so one writer can append it to the collection at once.

- :class:`SerialBackend`: in this process (supports callbacks);
- :class:`LocalBackend`: a pool of processes on this machine, one torch thread each;
- :class:`~train_zoo.backends.ray_backend.RayBackend`: Ray tasks on a cluster (optional
  extra, ``pip install posteriorzoo[ray]``; imported only when chosen).
"""

from train_zoo.backends.local import LocalBackend, SerialBackend, groups, make_backend

__all__ = ["LocalBackend", "SerialBackend", "groups", "make_backend"]
