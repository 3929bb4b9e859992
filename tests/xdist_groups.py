"""How `make test`'s two pytest-xdist workers share the suite.

A 2-core machine spends much of a serial run on one core: processes importing torch,
servers starting, engine cores handshaking, Python between small steps. Two workers fill
the other core. The unit of work is a module, never a single test, so a module's fixtures
(its servers, engines and peer processes) are built once; modules that share a costly
session fixture form one unit, so that fixture is built on one worker only.

xdist's own grouping (``--dist loadgroup``) renames node ids, which pytest 9 no longer
allows, so the grouping is a scheduler of its own (``pytest_xdist_make_scheduler``).
"""

from __future__ import annotations

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


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _GROUP_OF_MODULE.get(module.removeprefix("tests/"), module)

    return ModuleGroupScheduling(config, log)
