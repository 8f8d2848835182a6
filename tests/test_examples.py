"""``python -m ampdoctor.examples``: the sample specs for a user of the released package (the wheel ships them,
see setup.py; .ci/run installs the wheel in a fresh venv and runs README's sample from them)."""

from __future__ import annotations

from pathlib import Path

from ampdoctor import examples

ROOT = Path(__file__).resolve().parent.parent


def test_the_samples_are_copied_where_readme_runs_them(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    assert examples.main([]) == 0  # python -m ampdoctor.examples (.ci/run runs it so, from the wheel)
    out = capsys.readouterr().out
    shipped = sorted(p.name for p in (ROOT / "sample_models").glob("*.py"))
    assert sorted(p.name for p in (tmp_path / "sample_models").glob("*.py")) == shipped
    assert (tmp_path / "sample_models" / "forward_overflow.py").read_bytes() == (ROOT / "sample_models" / "forward_overflow.py").read_bytes()
    assert out == (f"{len(shipped)} sample spec(s) written to sample_models; "
                        "try: ampdoctor triage sample_models/forward_overflow.py\n")


def test_a_file_of_the_users_is_never_overwritten(tmp_path: Path) -> None:
    mine = tmp_path / "specs" / "healthy.py"
    mine.parent.mkdir()
    mine.write_text("# my own edits\n")
    written = examples.copy_samples(tmp_path / "specs")
    assert mine.read_text() == "# my own edits\n" and mine not in written
    assert (tmp_path / "specs" / "forward_overflow.py") in written
    assert examples.copy_samples(tmp_path / "specs") == []  # a second run writes nothing


def test_bad_folders_get_one_line_and_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "a_file"
    f.write_text("")
    assert examples.main([str(f)]) == 2
    assert capsys.readouterr().err == f"error: {f} is a file; give a folder for the sample specs\n"
    assert examples.main(["a", "b"]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m ampdoctor.examples [FOLDER]")


def test_a_clone_running_it_in_its_own_root_changes_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(ROOT)
    assert examples.copy_samples(Path("sample_models")) == []
