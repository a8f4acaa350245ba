"""An emulated cluster on one machine: hosts as network namespaces on a shaped bridge.

Each host is a network namespace with one veth link into a bridge (in a
namespace of its own, the switch); its egress is shaped by ``tc``'s token
bucket (``tbf``) to a rate, so bytes between hosts cost time as on a real
link of that rate. ``netem`` (added delay, loss) is not in these kernels: the
links have a rate, no latency beyond the machine's own. Every host shares the
machine's cores, memory and files. Making namespaces needs root; where they
cannot be made, :class:`EmulatedCluster` raises :class:`ClusterUnavailable`.

Everything made is removed on exit, on an exception, and on SIGTERM / SIGINT
(the handlers re-raise as ``KeyboardInterrupt`` after cleaning up). Names
carry the process id, so clusters of concurrent processes do not collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import FrameType

__all__ = ["ClusterUnavailable", "EmulatedCluster", "namespaces_available"]

SUBNET = "10.77"  # private, only inside the namespaces made here; never routed elsewhere


class ClusterUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or refused)."""


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", "netns", "exec", namespace, *args] if namespace else list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise ClusterUnavailable(f"{' '.join(command)}: {done.stderr.strip()}")


def namespaces_available() -> str | None:
    """Why an emulated cluster cannot be made here, or ``None`` if it can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tlprobe{os.getpid()}"
    try:
        _ip("ip", "netns", "add", probe)
    except ClusterUnavailable as refused:
        return f"network namespaces cannot be made: {refused}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class EmulatedCluster:
    """``hosts`` namespaces, host ``i`` at ``address(i)``, each link shaped to
    ``rate_gbps`` (``None``: unshaped). Use as a context manager."""

    def __init__(self, hosts: int, rate_gbps: float | None, subnet: int = 0) -> None:
        if hosts < 1:
            raise ValueError(f"a cluster needs at least one host, got {hosts}")
        if rate_gbps is not None and not rate_gbps > 0:
            raise ValueError(f"the link rate must be positive (Gbit/s), got {rate_gbps}")
        self.hosts, self.rate_gbps, self.subnet = hosts, rate_gbps, subnet
        tag = f"{os.getpid() % 100000}{subnet}"
        self.switch = f"tls{tag}"
        self.names = [f"tlh{tag}x{i}" for i in range(hosts)]
        self._made: list[str] = []
        self._started: list[subprocess.Popen] = []
        self._handlers: dict[int, object] = {}

    def address(self, host: int) -> str:
        return f"{SUBNET}.{self.subnet}.{host + 1}"

    def interface(self, host: int) -> str:
        """The host's link (for ``GLOO_SOCKET_IFNAME``)."""
        return f"v{host}"

    def __enter__(self) -> EmulatedCluster:
        why = namespaces_available()
        if why is not None:
            raise ClusterUnavailable(why)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise KeyboardInterrupt(f"signal {signum}")

    def _add_namespace(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _ip("ip", "link", "add", "br0", "type", "bridge", namespace=self.switch)
        _ip("ip", "link", "set", "br0", "up", namespace=self.switch)
        for i, name in enumerate(self.names):
            self._add_namespace(name)
            # Made inside the host's namespace, so no name is ever taken in the caller's.
            _ip(
                "ip",
                "link",
                "add",
                f"v{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                namespace=name,
            )
            _ip("ip", "link", "set", f"p{i}", "netns", self.switch, namespace=name)
            _ip("ip", "link", "set", f"p{i}", "master", "br0", namespace=self.switch)
            _ip("ip", "link", "set", f"p{i}", "up", namespace=self.switch)
            _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", f"v{i}", namespace=name)
            _ip("ip", "link", "set", f"v{i}", "up", namespace=name)
            _ip("ip", "link", "set", "lo", "up", namespace=name)
            if self.rate_gbps is not None:
                rate_bytes = self.rate_gbps * 1e9 / 8
                burst = max(256 * 1024, int(rate_bytes * 0.002))  # 2 ms of the rate
                _ip(
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    f"v{i}",
                    "root",
                    "tbf",
                    "rate",
                    f"{self.rate_gbps}gbit",
                    "burst",
                    str(burst),
                    "latency",
                    "100ms",
                    namespace=name,
                )

    def run(
        self, host: int, command: Sequence[str], env: Mapping[str, str] | None = None, **popen
    ) -> subprocess.Popen:
        """Start ``command`` on ``host`` (in its namespace), with ``env`` added."""
        full_env = {**os.environ, **(env or {})}
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *command],
            env=full_env,
            start_new_session=True,
            **popen,
        )
        self._started.append(process)
        return process

    def close(self) -> None:
        """Stop what was started on the hosts, remove every namespace made (their links go
        with them); idempotent."""
        while self._started:
            process = self._started.pop()
            if process.poll() is None:  # its whole session: torchrun and its workers
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._handlers.clear()
