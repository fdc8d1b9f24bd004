"""Name the rank that died, instead of a bare "connection closed" or a hang until the timeout.

Each rank's background thread adds 1 to its counter in the job's store
every `interval_s`. When a collective raises (a SIGKILLed peer closes its
sockets, and Gloo reports the closed connection at once; a frozen peer makes
the collective time out), `naming_dead_ranks` reads every counter twice,
`probe_s` apart: the ranks whose counters did not move are dead or frozen,
and the error names them. Counters, not clocks: nodes' clocks need not agree.
Keys carry torchrun's restart count, so a restarted job never reads the
counters of the one before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from runtime.launch.env import DistEnv, LaunchError
from runtime.launch.rendezvous import attempt_prefix

__all__ = ["Heartbeat", "PeerLost"]


class PeerLost(LaunchError):
    """A collective failed because these ranks stopped: killed, crashed or frozen."""


class Heartbeat:
    def __init__(self, env: DistEnv, *, interval_s: float = 0.5, probe_s: float = 2.5):
        self.rank, self.world = env.rank, env.world_size
        self.interval_s, self.probe_s = interval_s, probe_s
        self.lost = False
        prefix = f"{attempt_prefix()}/heartbeat"  # a restarted attempt must not see the dead one's counters
        # A client connection of its own to the job's store (rank 0's, or torchrun's agent's): the main
        # thread's group traffic never waits on it.
        self._store = dist.PrefixStore(prefix, dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                                                             timeout=timedelta(seconds=30)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._run, daemon=True, name="heartbeat").start()

    def _beat(self) -> None:
        with self._lock:
            self._store.add(f"rank{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending; the main thread reports it
                return

    def counters(self) -> list[int]:
        with self._lock:
            return [self._store.add(f"rank{r}", 0) for r in range(self.world)]

    def stopped_ranks(self) -> list[int]:
        """The other ranks whose counters do not move within probe_s."""
        before = self.counters()
        time.sleep(self.probe_s)
        after = self.counters()
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    @contextlib.contextmanager
    def naming_dead_ranks(self, what: str) -> Iterator[None]:
        try:
            yield
        except LaunchError:
            raise
        except Exception as exc:  # Gloo raises RuntimeError / DistBackendError subclasses
            try:
                dead = self.stopped_ranks()
            except Exception:  # the store's host died with it: rank 0 under a plain tcp:// rendezvous
                dead = None
            if dead == []:
                raise
            self.lost = True
            who = "the rank hosting the store (rank 0)" if dead is None else \
                f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))}"
            raise PeerLost(
                f"{who} stopped during {what} (no heartbeat for {self.probe_s:g} s: killed, crashed or frozen), so "
                f"rank {self.rank}'s collective failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}. "
                "Restart the job; with --save-dir/--save-every and --resume-from auto it continues from the last "
                "checkpoint") from exc

    def close(self) -> None:
        self._stop.set()
