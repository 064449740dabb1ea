"""The package installs, imports without optional dependencies, and exposes a small typed API."""

import json
import subprocess
import sys
import textwrap

import pytest

import lightning_gh
from lightning_gh.__main__ import main


def test_version_and_public_api():
    assert lightning_gh.__version__
    for name in lightning_gh.__all__:
        assert hasattr(lightning_gh, name), name


def test_import_without_optional_dependencies():
    # A meta-path hook makes nvtx, torchao and transformer_engine unimportable, as on a bare install.
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('nvtx', 'torchao', 'transformer_engine'):
                    raise ImportError(f'blocked {name}')
        sys.meta_path.insert(0, Block())
        import lightning_gh, lightning_gh.demo, lightning_gh.hardware
        from lightning_gh.demo.run import main
        mods = [m for m in sys.modules if m.split('.')[0] in ('nvtx', 'torchao', 'transformer_engine')]
        assert not mods, mods
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


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


def test_cli_entry_point_runs():
    """The one end-to-end run of ``python -m lightning_gh`` (the tests above call its ``main`` in this process)."""
    out = subprocess.run([sys.executable, "-m", "lightning_gh", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["precisions"]["bf16-mixed"] == "available"
