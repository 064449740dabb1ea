"""The extras: a CPU development box gets one that installs there; only `te` needs a CUDA machine."""

from pathlib import Path

import tomllib

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def expand(name: str) -> set[str]:
    """The extras ``name`` stands for, its own name included (self-references like lightning-gh[a,b] expanded)."""
    out = {name}
    for req in EXTRAS[name]:
        if req.startswith("lightning-gh["):
            for inner in req[len("lightning-gh["):-1].split(","):
                out |= expand(inner.strip())
    return out


def test_the_cpu_extra_has_everything_but_transformer_engine():
    assert expand("cpu") == {"cpu", "nvtx", "ao", "hf", "dev"}
    assert not any("transformer-engine" in r for e in expand("cpu") for r in EXTRAS[e])


def test_all_is_cpu_plus_transformer_engine():
    assert expand("all") == expand("cpu") | {"all", "te"}
    assert any("transformer-engine" in r for r in EXTRAS["te"])
