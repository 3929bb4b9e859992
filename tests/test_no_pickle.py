"""Nothing in kvserve unpickles: checked on the syntax tree of every module in the package.

Pickle runs code while it loads, so a frame from a socket, a file another process wrote or a
remote store must never reach it. The wire formats are msgspec; this test keeps it that way
by refusing the modules and the calls that unpickle under another name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}
# pyzmq's and multiprocessing's object transports pickle under the hood, and so do
# torch.distributed's object collectives (parallel_state sends msgpack headers instead).
FORBIDDEN_METHODS = {
    "recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
}  # fmt: skip
PACKAGE = Path(kvserve.__file__).parent
FILES = sorted(PACKAGE.rglob("*.py"))


def _violations(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            keywords = {k.arg: k.value for k in node.keywords}
            if name in FORBIDDEN_METHODS:
                found.append(name)
            # torch.load unpickles unless weights_only=True; numpy only with allow_pickle.
            if name == "load" and isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "torch":
                    weights_only = keywords.get("weights_only")
                    if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                        found.append("torch.load without weights_only=True")
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is True:
                found.append("allow_pickle=True")
    return found


def test_the_package_is_scanned_whole() -> None:
    # Every subpackage, so a new module cannot slip past the scan.
    assert len(FILES) > 100
    assert {p.relative_to(PACKAGE).parts[0] for p in FILES} >= {
        "engine",
        "entrypoints",
        "kvcache",
        "distributed",
        "worker",
    }


def test_no_module_unpickles() -> None:
    found = {
        str(path.relative_to(PACKAGE)): v
        for path in FILES
        if (v := _violations(ast.parse(path.read_text(), str(path))))
    }
    assert found == {}


def test_the_check_catches_each_way_to_unpickle() -> None:
    samples = [
        "import pickle",
        "from cloudpickle import loads",
        "sock.recv_pyobj()",
        "torch.load(path)",
        "numpy.load(path, allow_pickle=True)",
        "dist.broadcast_object_list(objs, src=0)",
        "torch.distributed.recv_object_list(objs)",
    ]
    for source in samples:
        assert _violations(ast.parse(source)), source
    assert _violations(ast.parse("torch.load(path, weights_only=True)")) == []
