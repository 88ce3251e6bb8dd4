"""`LocalRedisServer`: a throwaway ``redis-server`` on a loopback port.

For tests, the demo and the benchmark: it starts the Debian/Ubuntu
``redis-server`` binary (``apt-get install redis-server``; or the path in
``$KVTIER_REDIS_SERVER``) on a free port of 127.0.0.1 with its own directory,
waits until it answers ``PING``, and kills it on `stop`. Nothing here talks
to any server it did not start.

* ``persistent=False`` (default): no RDB snapshots, no AOF (``--save ''
  --appendonly no``); killing it loses everything.
* ``persistent=True``: ``--appendonly yes --appendfsync always``: every write
  is in the AOF before it is acknowledged and the AOF is replayed in order at
  start, so a `kill` then `start` (same port, same directory) shows exactly
  the writes that were applied before the kill.
* ``cluster=True``: a one-node Redis Cluster that owns all 16384 slots, to
  exercise the cluster client path.

`LocalRedisCluster` starts several such nodes (three masters by default),
splits the 16384 hash slots between them and joins them: a real cluster on
loopback ports, where pages spread over the nodes and the client follows
MOVED redirections.

The methods block (process start, socket waits): from async code call them
through ``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["LocalRedisCluster", "LocalRedisServer", "find_redis_server"]


def find_redis_server() -> str | None:
    """Path of the redis-server binary ($KVTIER_REDIS_SERVER, else on PATH), or None."""
    explicit = os.environ.get("KVTIER_REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


# A cluster node also listens on its port + 10000 (the cluster bus), so redis-server
# refuses a cluster port above this; every server takes one at most this.
MAX_PORT = 55535


def _free_port() -> int:
    """A free loopback port of at most `MAX_PORT` (the kernel's ephemeral range
    reaches past it, to 60999 on Linux)."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port <= MAX_PORT:
            return port
    raise RuntimeError(f"no free loopback port at most {MAX_PORT} in 1000 tries")


def _resp(*args: str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        data = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class LocalRedisServer:
    """One redis-server process; ``url`` is ``redis://127.0.0.1:<port>/0``.

    Raises `FileNotFoundError` from `start` when no redis-server binary is
    found, `RuntimeError` when it does not come up (with its log's tail).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        port: int | None = None,
        persistent: bool = False,
        cluster: bool = False,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.directory = Path(directory)
        self.port = port
        self._fixed_port = port is not None
        self.persistent = persistent
        self.cluster = cluster
        self.binary = binary
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the redis server has not been started")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        """Start it (again, on the same port and directory after `kill`) and
        wait until it answers PING (and, for a cluster, reports state ok)."""
        binary = self.binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("redis-server not found: apt-get install redis-server, or set $KVTIER_REDIS_SERVER")
        self.directory.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port else 5
        for attempt in range(attempts):
            if not self._fixed_port and (attempt or self.port is None):
                self.port = _free_port()
            try:
                self._spawn(binary, timeout_s)
                return self
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _spawn(self, binary: str, timeout_s: float) -> None:
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--daemonize", "no", "--protected-mode", "no",
        ]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += list(self.extra_args)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed right after
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                if self.command("PING", timeout_s=0.5).startswith(b"+PONG"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {timeout_s} s: {self._log_tail()}")
            time.sleep(0.02)
        if self.cluster:
            info = self.command("CLUSTER", "INFO")
            if b"cluster_slots_assigned:16384" not in info:
                self.command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            while b"cluster_state:ok" not in self.command("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach state ok")
                time.sleep(0.05)

    def command(self, *args: str, timeout_s: float = 5.0) -> bytes:
        """Send one command on a fresh connection; the raw reply (simple or bulk)."""
        if self.port is None:
            raise RuntimeError("the redis server has not been started")
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as s:
            s.sendall(_resp(*args))
            data = b""
            while b"\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("redis-server closed the connection")
                data += chunk
            if data.startswith(b"$"):
                size = int(data[1:data.index(b"\r\n")])
                need = data.index(b"\r\n") + 2 + max(size, 0) + 2
                while len(data) < need:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionError("redis-server closed the connection")
                    data += chunk
            return data

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no save) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing until `resume`."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server if it runs (a paused one is resumed first so it can die)."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
        self.kill()

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-800:]
        except OSError:
            return "(no log)"

    def __repr__(self) -> str:
        state = "running" if self.process is not None and self.process.poll() is None else "stopped"
        return f"<LocalRedisServer 127.0.0.1:{self.port} [{state}, persistent={self.persistent}, cluster={self.cluster}]>"


class LocalRedisCluster:
    """``masters`` redis-server processes joined into one Redis Cluster.

    Each node owns an equal run of the 16384 hash slots; ``url`` is the first
    node's (a cluster client finds the others from it). Raises like
    `LocalRedisServer.start`, and `RuntimeError` when the nodes do not agree
    within ``timeout_s``; a failed start stops every node it started.
    """

    SLOTS = 16384

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        masters: int = 3,
        binary: str | None = None,
        require_full_coverage: bool = True,
        node_timeout_ms: int = 5000,
    ) -> None:
        if isinstance(masters, bool) or not isinstance(masters, int) or masters < 1:
            raise ValueError(f"masters must be an int >= 1; got {masters!r}")
        if isinstance(node_timeout_ms, bool) or not isinstance(node_timeout_ms, int) or node_timeout_ms < 100:
            raise ValueError(f"node_timeout_ms must be an int >= 100; got {node_timeout_ms!r}")
        self.directory = Path(directory)
        # require_full_coverage=False (cluster-require-full-coverage no): while a
        # master is down, the others go on serving their own slots.
        self.nodes = [
            LocalRedisServer(
                self.directory / f"node{i}", binary=binary,
                extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                            "--cluster-node-timeout", str(node_timeout_ms),
                            "--cluster-require-full-coverage", "yes" if require_full_coverage else "no"),
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 20.0) -> LocalRedisCluster:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            n = len(self.nodes)
            for i, node in enumerate(self.nodes):
                first, last = i * self.SLOTS // n, (i + 1) * self.SLOTS // n - 1
                node.command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
            for node in self.nodes[1:]:
                self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", str(node.port))
            deadline = time.monotonic() + timeout_s
            while not all(self._agrees(node) for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {n} redis cluster nodes did not agree within {timeout_s} s: "
                                       f"{self.nodes[0].command('CLUSTER', 'INFO')!r}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def failed_by_the_others(self, index: int) -> bool:
        """Whether every other running node flags node ``index`` ``fail`` in
        CLUSTER NODES (not just ``fail?``): the cluster has agreed it is down."""
        port = self.nodes[index].port
        for i, node in enumerate(self.nodes):
            if i == index or node.process is None:
                continue
            lines = node.command("CLUSTER", "NODES").decode(errors="replace").splitlines()
            flags = [line.split()[2].split(",") for line in lines if f"127.0.0.1:{port}@" in line]
            if not flags or "fail" not in flags[0]:
                return False
        return True

    def _agrees(self, node: LocalRedisServer) -> bool:
        info = node.command("CLUSTER", "INFO")
        return b"cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}".encode() in info

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalRedisCluster {len(self.nodes)} masters, ports {[n.port for n in self.nodes]}>"
