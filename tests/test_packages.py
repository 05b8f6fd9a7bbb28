"""otel_rl.exporters.packages: the installed packages from the metadata headers, compared with the full
metadata parser and with pip itself (the trackers' run files are checked in tests/trackers)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from otel_rl.exporters import packages


def test_header_reading_gives_what_the_full_parser_gives_in_the_same_order():
    full = [(d.metadata["Name"], d.version) for d in importlib.metadata.distributions()]
    assert list(packages.distributions()) == full
    assert len(full) > 10


def test_pip_freeze_list_is_what_pip_prints(tmp_path):
    # both in a fresh interpreter: this one's sys.path may hold more (Ray, once imported, adds its vendored
    # packages), which pip, started as a child process, would not see
    ours = subprocess.run([sys.executable, "-c", "import sys; from otel_rl.exporters import packages; "
                           "sys.stdout.write(packages.pip_freeze_list())"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    pip = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert pip.returncode == 0 and ours.returncode == 0, pip.stderr + ours.stderr
    assert ours.stdout == pip.stdout
    assert len(pip.stdout.splitlines()) > 10


def _dist(tmp_path, name: str, text: str) -> importlib.metadata.Distribution:
    d = tmp_path / f"{name}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(text, encoding="utf-8")
    return importlib.metadata.Distribution.at(d)


def test_unusual_headers_fall_back_to_the_full_parser(tmp_path):
    # CRLF line ends, headers in another order, a folded summary
    crlf = _dist(tmp_path, "a", "Metadata-Version: 2.1\r\nSummary: x\r\n  y\r\nVersion: 1.2\r\nName: pkg-a\r\n\r\nbody\r\n")
    assert packages.name_version(crlf) == ("pkg-a", "1.2") == (crlf.metadata["Name"], crlf.version)
    # Version only after the first blank line: not a header; the full parser decides (no version)
    no_version = _dist(tmp_path, "b", "Metadata-Version: 2.1\nName: pkg-b\n\nVersion: 9\n")
    assert packages.name_version(no_version) == (no_version.metadata["Name"], no_version.version) == ("pkg-b", None)
    empty = _dist(tmp_path, "c", "")
    assert packages.name_version(empty) == (empty.metadata["Name"], empty.version) == (None, None)


def _package(tmp_path, monkeypatch, name: str) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, f"{name}.sub", raising=False)


def test_hidden_imports_fail_in_this_thread_only_and_only_inside_the_block(tmp_path, monkeypatch):
    import importlib
    import threading

    import pytest

    _package(tmp_path, monkeypatch, "otel_rl_hidden_pkg")
    seen_by_other_thread = []
    with packages.hidden_imports(["otel_rl_hidden_pkg", "json"]):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("otel_rl_hidden_pkg")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("otel_rl_hidden_pkg.sub")
        import json  # noqa: F401  (already imported: never hidden)

        t = threading.Thread(target=lambda: seen_by_other_thread.append(importlib.import_module("otel_rl_hidden_pkg.sub")))
        t.start()
        t.join()
        sys.modules.pop("otel_rl_hidden_pkg.sub", None)
        sys.modules.pop("otel_rl_hidden_pkg", None)
        with packages.hidden_imports([]):  # nested: the outer names stay hidden
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module("otel_rl_hidden_pkg")
    assert [m.VALUE for m in seen_by_other_thread] == [2]
    assert importlib.import_module("otel_rl_hidden_pkg.sub").VALUE == 2  # after the block: as usual
    assert "otel_rl_hidden_pkg" not in packages._hider.hidden.get(threading.get_ident(), ())
