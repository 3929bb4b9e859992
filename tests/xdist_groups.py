"""How `make test`'s two pytest-xdist workers share the suite.

A 2-core machine spends much of a serial run on one core: processes importing torch,
servers starting, engine cores handshaking, Python between small steps. Two workers fill
the other core. The unit of work is a module, never a single test, so a module's fixtures
(its servers, engines and peer processes) are built once; modules that share a costly
session fixture form one unit, so that fixture is built on one worker only.

xdist's own grouping (``--dist loadgroup``) renames node ids, which pytest 9 no longer
allows, so the grouping is a scheduler of its own (``pytest_xdist_make_scheduler``).

The units go out longest first. xdist's default order (most tests first) handed out the
slow end-to-end modules, few tests each, last, so one worker ran the final long module
while the other sat idle. A unit's length is what its modules took in the last full run
on this checkout (pytest's cache), else in the run recorded in module_durations.json (a
fresh clone's, CI's): ``record_durations`` keeps both; refresh the file with
``python -m tests.xdist_groups`` after a full run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

# Group name -> (the session fixtures that make it costly, the modules using them; paths
# relative to tests/). A module using one of the fixtures from outside its group fails the
# collection, so the list cannot silently go stale.
SHARED_SESSION_FIXTURES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # Gemma 3 270M's engine and its HF transformers reference: ~1 min to build.
    "gemma3": (
        frozenset({"gemma3_llm_factory", "gemma3_hf"}),
        frozenset(
            {
                "core/test_hybrid_kv_cache_gemma3.py",
                "distributed/kv_transfer/test_hybrid_connectors_gemma3.py",
                "model_executor/test_gemma3.py",
            }
        ),
    ),
}
_GROUP_OF_MODULE = {
    module: group for group, (_, modules) in SHARED_SESSION_FIXTURES.items() for module in modules
}


def check_shared_fixture_groups(item: pytest.Item, module: str) -> None:
    """Fails the collection where a module uses a group's session fixture unlisted."""
    used = set(getattr(item, "fixturenames", ()))
    for group, (fixtures, modules) in SHARED_SESSION_FIXTURES.items():
        if used & fixtures and module not in modules:
            raise pytest.UsageError(
                f"tests/{module} uses {sorted(used & fixtures)}: add it to the {group!r} "
                "modules in tests/xdist_groups.py (one worker builds those fixtures)"
            )


DURATIONS_FILE = Path(__file__).with_name("module_durations.json")
_CACHE_KEY = "kvserve/module_durations"


def _unit_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return _GROUP_OF_MODULE.get(module.removeprefix("tests/"), module)


def _known_durations(config: pytest.Config) -> dict[str, float]:
    """Seconds per module (node-id form, tests/...): the committed run's, then this
    checkout's own last full run over them."""
    durations: dict[str, float] = {}
    if DURATIONS_FILE.exists():
        durations.update(json.loads(DURATIONS_FILE.read_text()))
    cache = getattr(config, "cache", None)
    if cache is not None:
        durations.update(cache.get(_CACHE_KEY, {}))
    return durations


class DurationRecorder:
    """Sums each module's setup, call and teardown seconds over a run (on the xdist
    controller, which sees every worker's reports) and keeps them in pytest's cache when
    the run was a full one: a run of a few tests or one marker would record a module's
    part as its whole."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        option = self.config.option
        full_run = not self.config.args or self.config.args == ["tests"]
        narrowed = option.keyword or option.markexpr or option.lf or option.deselect
        if full_run and not narrowed and self.seconds:
            rounded = {module: round(s, 1) for module, s in sorted(self.seconds.items())}
            self.config.cache.set(_CACHE_KEY, rounded)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    durations = _known_durations(config)
    # A module no run has timed yet: as long as a typical one.
    typical = sorted(durations.values())[len(durations) // 2] if durations else 1.0

    class ModuleGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:
                seconds: defaultdict[str, float] = defaultdict(float)
                modules = {(_unit_of(n), n.split("::", 1)[0]) for n in self.collection}
                for unit, module in modules:
                    seconds[unit] += durations.get(module, typical)
                for unit in sorted(self.workqueue, key=lambda u: -seconds[u]):
                    self.workqueue.move_to_end(unit)
                self._ordered = True
            super()._assign_work_unit(node)

    return ModuleGroupScheduling(config, log)


def save_durations() -> None:
    """Copies this checkout's last full run's module durations into DURATIONS_FILE."""
    recorded = Path(__file__).parent.parent / ".pytest_cache" / "v" / _CACHE_KEY
    if not recorded.exists():
        sys.exit(f"no recorded durations in {recorded}: run the whole suite first")
    durations = json.loads(recorded.read_text())
    DURATIONS_FILE.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    save_durations()
