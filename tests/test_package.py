"""The package installs, imports without optional dependencies, and exposes a small typed API."""

import json

import pytest

import lightning_gh
from lightning_gh.__main__ import main


def test_version_and_public_api():
    assert lightning_gh.__version__
    for name in lightning_gh.__all__:
        assert hasattr(lightning_gh, name), name


def test_import_without_optional_dependencies(fresh_import_report):
    # A meta-path hook makes nvtx, torchao and transformer_engine unimportable, as on a bare install; then
    # lightning_gh, its demo and hardware modules and the demo's main import with none of them loaded (a forked
    # child of a fresh interpreter with no lightning_gh module yet: tests/conftest.py, BARE_INSTALL_CODE).
    bare = fresh_import_report["children"]["bare"]
    assert bare["code"] == 0, fresh_import_report["stderr"][-3000:]


def test_cli_usage_and_unknown_command(capsys):
    assert main([]) == 2 and "demo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ok:
        main(["--help"])
    assert ok.value.code == 0 and "demo" in capsys.readouterr().out
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_cli_info_is_json(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) >= {"cuda_available", "fp8_capable", "is_grace_hopper", "host_arch", "extras", "precisions"}
    assert set(info["extras"]) == {"nvtx", "ao", "te", "transformers"}
    assert info["precisions"]["bf16-mixed"] == "available"
    with pytest.raises(SystemExit) as helped:
        main(["info", "--help"])
    out = capsys.readouterr().out
    assert helped.value.code == 0 and "--bandwidth" in out and not out.lstrip().startswith("{")


def test_cli_entry_point_runs(fresh_import_report):
    """The one end-to-end run of the package as ``python -m lightning_gh info`` runs it (``runpy``, in a fresh
    interpreter with no lightning_gh module loaded yet: tests/conftest.py); the tests above call its ``main`` in
    this process, and tests/test_demo.py starts ``python -m lightning_gh demo`` itself."""
    cli = fresh_import_report["children"]["cli"]
    assert cli["code"] == 0, fresh_import_report["stderr"][-3000:]
    assert json.loads(cli["stdout"])["precisions"]["bf16-mixed"] == "available"
