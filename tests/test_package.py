"""The package installs, imports without optional dependencies, and exposes a small typed API."""

import subprocess
import sys
import textwrap

import lightning_gh


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


def test_cli_usage_and_unknown_command():
    ok = subprocess.run([sys.executable, "-m", "lightning_gh", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "demo" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "lightning_gh", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr


def test_cli_info_is_json():
    import json

    out = subprocess.run([sys.executable, "-m", "lightning_gh", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert set(info) >= {"cuda_available", "fp8_capable", "is_grace_hopper", "host_arch", "extras", "precisions"}
    assert set(info["extras"]) == {"nvtx", "ao", "te", "transformers"}
    assert info["precisions"]["bf16-mixed"] == "available"
    helped = subprocess.run([sys.executable, "-m", "lightning_gh", "info", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "--bandwidth" in helped.stdout and not helped.stdout.lstrip().startswith("{")
