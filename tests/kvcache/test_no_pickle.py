"""Nothing in the KV tier unpickles: no module imports pickle (or its relatives)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve.kvcache

FORBIDDEN = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
ROOTS = [Path(kvserve.kvcache.__file__).parent]
CONNECTOR = (
    Path(kvserve.kvcache.__file__).parent.parent
    / "distributed/kv_transfer/kv_connector/connectors/tiered_cache.py"
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_kvcache_never_imports_pickle() -> None:
    files = [p for root in ROOTS for p in root.rglob("*.py")]
    if CONNECTOR.exists():
        files.append(CONNECTOR)
    assert len(files) > 10
    for path in files:
        assert not (_imports(path) & FORBIDDEN), path
        text = path.read_text()
        assert "torch.load(" not in text and "pickle" not in text.replace("no pickle", ""), path
