"""Where training runs. Every backend has ``run(spec, indices, engine) -> Iterator[result]``:
it produces the given modes and yields their :class:`CheckpointResult` in the order of
``indices`` (mode order, a mode's samples together), each as soon as it and the modes
before it are done, so one writer can append them to the collection at once, in order.
A mode that finishes before an earlier one waits, counted among the tasks in flight, so
the results held back are bounded.

- :class:`SerialBackend`: in this process (supports callbacks);
- :class:`LocalBackend`: a pool of processes on this machine, one torch thread each;
- :class:`~train_zoo.backends.ray_backend.RayBackend`: Ray tasks on a cluster (optional
  extra, ``pip install posteriorzoo[ray]``; imported only when chosen).
"""

from __future__ import annotations

from collections.abc import Sequence

from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.vocabulary import BACKENDS
from train_zoo.backends.local import LocalBackend, SerialBackend
from train_zoo.backends.tasks import groups

__all__ = ["BACKENDS", "LocalBackend", "SerialBackend", "groups", "make_backend"]


def make_backend(name: str, workers: int | None = None, group_size: int = 1,
                 address: str | None = None, callbacks: Sequence[object] = (),
                 num_gpus: float = 0.0, device: str = "cpu") -> object:
    """A backend by name: ``local``, ``serial`` or ``ray`` (``num_gpus``: GPUs per Ray
    task, ray only; ``device``: where the local and serial backends train, ``cpu``,
    ``cuda`` or ``cuda:N``; a Ray task trains where its ``num_gpus`` puts it)."""
    if name not in BACKENDS:
        raise UnknownNameError(f"unknown backend {name!r}; backends: {', '.join(BACKENDS)}")
    if callbacks and name != "serial":
        raise InvalidOptionError("callbacks run only with the serial backend")
    if num_gpus and name != "ray":
        raise InvalidOptionError("GPUs per task (num_gpus) are an option of the ray backend")
    if device != "cpu" and name == "ray":
        raise InvalidOptionError("a Ray task trains on the GPUs Ray grants it: give it "
                                 "num_gpus (--num-gpus) instead of a device")
    if name == "serial":
        return SerialBackend(group_size, callbacks, device)
    if name == "local":
        return LocalBackend(workers, group_size=group_size, device=device)
    from train_zoo.backends.ray_backend import RayBackend

    return RayBackend(address=address, num_cpus=workers, group_size=group_size,
                      num_gpus=num_gpus)
