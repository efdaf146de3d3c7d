"""The documentation against the code (unit tier).

* ``jobs/CONFIG.md`` is what :func:`mpitrain.config.reference` generates from
  ``mpitrain/config.py``, and every config field has a ``#:`` comment saying what it means.
"""

from pathlib import Path

import pytest

from mpitrain import config

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_current():
    committed = (ROOT / "jobs" / "CONFIG.md").read_text(encoding="utf-8")
    assert committed == config.reference(), (
        "jobs/CONFIG.md differs from what mpitrain/config.py generates; regenerate it with: "
        "mpitrain config reference --out jobs/CONFIG.md")


def test_config_reference_names_every_field_and_refuses_a_field_without_a_meaning(tmp_path, monkeypatch):
    page = config.reference()
    for section, fields in config.Config().to_dict().items():
        assert f"## [{section}]" in page
        for name in fields:
            assert f"| `{name}` |" in page, f"{section}.{name}"
    source = Path(config.__file__).read_text(encoding="utf-8")
    stripped = tmp_path / "config.py"
    stripped.write_text(source.replace("keep: int = 3  #:", "keep: int = 3  #"), encoding="utf-8")
    monkeypatch.setattr(config, "__file__", str(stripped))
    with pytest.raises(ValueError, match=r"run\.keep: no '#:' comment"):
        config.reference()
