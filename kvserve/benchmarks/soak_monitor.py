"""Peak and current RSS of a server process and its children, sampled while a soak runs.

The server itself is "api_server"; its direct children started by multiprocessing's
spawn are "engine_core" (numbered if there are several). Other processes are left out:
multiprocessing's resource tracker, and short-lived helpers (a compiler check, a fork
before exec) that would otherwise look like a lost process. A process seen once and
gone later is reported in `lost`: an engine core that died mid-soak shows there.
"""

from __future__ import annotations

import asyncio
from typing import Any

MIB = 1024 * 1024


class RssSampler:
    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        import psutil  # a benchmark/test dependency, not the server's

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.roles: dict[int, str] = {}  # pid -> role
        self.peak: dict[str, int] = {}  # role -> bytes
        self.last: dict[str, int] = {}
        self.lost: list[str] = []
        self.sample()

    def _processes(self) -> list[Any]:
        try:
            children = self.root.children()
        except self._psutil.Error:
            return []
        kept = []
        for child in children:
            try:
                cmdline = " ".join(child.cmdline())
            except self._psutil.Error:
                continue
            if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
                kept.append(child)
        return [self.root, *kept]

    def _role(self, pid: int) -> str:
        if pid not in self.roles:
            if pid == self.root.pid:
                role = "api_server"
            else:
                taken = sum(r.startswith("engine_core") for r in self.roles.values())
                role = "engine_core" if taken == 0 else f"engine_core_{taken}"
            self.roles[pid] = role
        return self.roles[pid]

    def sample(self) -> None:
        seen = set()
        for proc in self._processes():
            try:
                rss = int(proc.memory_info().rss)
            except self._psutil.Error:
                continue
            role = self._role(proc.pid)
            seen.add(proc.pid)
            self.last[role] = rss
            self.peak[role] = max(self.peak.get(role, 0), rss)
        for pid, role in self.roles.items():
            if pid not in seen and role not in self.lost:
                self.lost.append(role)

    async def run(self) -> None:
        """Samples until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()

    def peak_mib(self) -> dict[str, float]:
        return {role: round(v / MIB, 1) for role, v in self.peak.items()}

    def last_mib(self) -> dict[str, float]:
        return {role: round(v / MIB, 1) for role, v in self.last.items()}
