"""`python scripts/mutate.py report` (`make mutate`'s last step): its exit status
says whether every module's mutants were measured and every survivor explained."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutate.py"


@pytest.fixture
def mutate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_mutate_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "WORK", tmp_path / ".mutmut")
    monkeypatch.setattr(module, "BASELINE", tmp_path / "baseline.json")
    (tmp_path / "baseline.json").write_text(json.dumps({"a": {"kvtier.a.x_f__mutmut_2": "equivalent: why"}}))
    return module


def _results(mutate: ModuleType, name: str, codes: dict[str, int]) -> None:
    meta = mutate.WORK / name / "mutants" / "kvtier" / f"{name}.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": codes}))


def test_a_module_with_no_results_fails_the_report_unless_its_venv_was_not_given(
    mutate: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    a = mutate.Module("a", ("kvtier/a.py",), ("tests/test_a.py",))
    b = mutate.Module("b", ("kvtier/b.py",), ("tests/test_b.py",))
    engine = mutate.Module("engine", ("kvtier/engine.py",), ("tests/test_engine.py",), venv="engine")
    _results(mutate, "a", {"kvtier.a.x_f__mutmut_1": 1, "kvtier.a.x_f__mutmut_2": 0})
    # a measured, its survivor justified; the engine's module not runnable here: passes
    assert mutate.report([a, engine], False, {}) == 0
    assert "engine: not run, it needs --python engine=PATH" in capsys.readouterr().err
    # b could have run and has no results: the report cannot say it was measured
    assert mutate.report([a, b], False, {}) == 1
    assert "UNEXPLAINED b: no results" in capsys.readouterr().err
    # given its venv, the engine's module must have results too
    assert mutate.report([a, engine], False, {"engine": sys.executable}) == 1
    _results(mutate, "b", {"kvtier.b.x_g__mutmut_1": 0})  # a survivor the baseline does not justify
    assert mutate.report([a, b], False, {}) == 1
    assert "kvtier.b.x_g__mutmut_1: survived, neither killed nor justified" in capsys.readouterr().err
