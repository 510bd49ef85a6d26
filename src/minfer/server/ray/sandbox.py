"""A Ray that talks to loopback only: the environment, the network namespace, the local cluster.

Ray on Linux reaches its own processes through the machine's non-loopback address even when
told 127.0.0.1, and reports usage statistics to an outside host. Tests and benchmarks here must
do neither, so every Ray they start goes through this module:

- `ray_env(tmpdir)`: usage statistics off; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which makes
  Ray take 127.0.0.1 as the node address; a private `RAY_TMPDIR` (no session files, sockets or
  "current cluster" address shared with anyone else's Ray on the machine).
- `isolated(argv)`: the command run inside a private network namespace holding only an `lo`
  that this module brings up (`python -m minfer.server.ray.sandbox MODULE ARGS...` is the
  entry that does it), where `unshare -n` works (root); otherwise the command unchanged.
- `LocalCluster`: a head node and worker nodes as separate processes (ray.cluster_utils), torn
  down by the pids it started; never `ray stop`, which stops every Ray on the machine by name.
"""

from __future__ import annotations

import fcntl
import functools
import os
import runpy
import shutil
import socket
import struct
import subprocess
import sys
from types import TracebackType
from typing import Any

SAFE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def ray_env(tmpdir: str) -> dict[str, str]:
    """The variables every Ray started by a test or benchmark gets (tmpdir: private)."""
    return {**SAFE_ENV, "RAY_TMPDIR": tmpdir}


def apply_ray_env(tmpdir: str) -> None:
    """Set ray_env in this process, before ray is imported (Ray reads some at import)."""
    os.environ.update(ray_env(tmpdir))


@functools.cache
def can_unshare() -> bool:
    """Whether `unshare -n` can make a network namespace here (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def isolated(argv: list[str]) -> list[str]:
    """The command that runs argv ([MODULE or SCRIPT.py, *ARGS]) with this interpreter, in a
    loopback-only network namespace where that is possible (else as it is)."""
    if can_unshare():
        return ["unshare", "-n", "--", sys.executable, "-m", __name__, *argv]
    if argv and argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return [sys.executable, "-m", *argv]


_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def loopback_up() -> None:
    """Bring `lo` up (a fresh network namespace has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def interfaces_up() -> list[str]:
    """Names of the interfaces this process's namespace has (a check for the isolated run)."""
    return [name for _, name in socket.if_nameindex()]


class LocalCluster:
    """A head node plus `workers` worker nodes on this machine, each its own raylet, every
    process started by this object and stopped by it (by pid)."""

    def __init__(self, *, workers: int = 1, cpus_per_node: int = 1,
                 object_store_bytes: int = 80 << 20) -> None:
        self.workers = workers
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_bytes
        self._cluster: Any = None

    def __enter__(self) -> LocalCluster:
        import ray
        from ray.cluster_utils import Cluster

        node = {"num_cpus": self.cpus_per_node, "object_store_memory": self.object_store_bytes,
                "node_ip_address": "127.0.0.1"}
        self._cluster = Cluster(initialize_head=True, head_node_args={
            **node, "include_dashboard": False})
        try:
            for _ in range(self.workers):
                self._cluster.add_node(**node)
            self._cluster.wait_for_nodes()
            ray.init(address=self._cluster.address, include_dashboard=False,
                     log_to_driver=False)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()  # kills the processes of every node it added, by pid
            self._cluster = None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _main() -> None:
    """`python -m minfer.server.ray.sandbox MODULE|SCRIPT.py ARGS...`: lo up, then run it."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m minfer.server.ray.sandbox MODULE|SCRIPT.py [ARGS...]")
    loopback_up()
    target = sys.argv[1]
    sys.argv = [target, *sys.argv[2:]]
    if target.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
