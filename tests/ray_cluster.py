"""A local two-node Ray cluster for the tests of the README's cluster recipe.

Both the training backend's test and the MMD tiles' test run against the same kind of
cluster: each node is ``ray start --block`` as a child of the test, in a home folder of
its own (as another machine), one CPU each, token authentication (RAY_AUTH_MODE=token
and one secret RAY_AUTH_TOKEN shared by every node and the driver). Ending the children
stops only this cluster.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def two_node_cluster(tmp_path: Path, extra_env: Mapping[str, str] | None = None,
                     head_args: Sequence[str] = ()) -> Iterator[tuple[str, dict[str, str]]]:
    """Start a head and a second node, wait until both are up, yield the cluster's
    address (``127.0.0.1:<port>``) and the head's environment (for the driver), and
    stop both nodes on exit.

    ``extra_env`` is added to every node's environment; ``head_args`` to the head's
    ``ray start``. The homes are ``tmp_path / "head"`` and ``tmp_path / "node"``.
    Fails (AssertionError) if the second node has not joined within 90 s.
    """
    ray_command = str(Path(sys.executable).with_name("ray"))
    port, token = free_port(), secrets.token_hex(32)
    address = f"127.0.0.1:{port}"

    def environment(home: str) -> dict[str, str]:
        (tmp_path / home).mkdir()
        return {**os.environ, "HOME": str(tmp_path / home), "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": token, **(extra_env or {})}

    head_env, node_env = environment("head"), environment("node")
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--block"]
    # Ray's session folder holds Unix sockets, whose paths may not exceed 107 bytes:
    # a short folder of its own, not pytest's deep tmp_path
    sessions = tempfile.mkdtemp(prefix="pz-ray-")
    nodes = [subprocess.Popen([ray_command, "start", "--head", f"--port={port}",
                               "--include-dashboard=false", f"--temp-dir={sessions}",
                               *head_args, *common], env=head_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        def alive() -> int:
            status = subprocess.run([ray_command, "status", f"--address={address}"],
                                    env=head_env, capture_output=True, text=True)
            return status.stdout.count(" node_") if status.returncode == 0 else 0

        deadline = time.monotonic() + 90
        while alive() < 1 and time.monotonic() < deadline:
            time.sleep(1)
        nodes.append(subprocess.Popen([ray_command, "start", f"--address={address}",
                                       *common], env=node_env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        while alive() < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert alive() == 2, "the second node did not join"
        yield address, head_env
    finally:
        for node in reversed(nodes):
            node.terminate()
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
        shutil.rmtree(sessions, ignore_errors=True)
