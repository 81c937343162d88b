"""research/compare_answers.py: answers are matched by (method, question, turn, temperature) and
compared by token ids; any difference, or no answer in common, is a failing exit status."""
import json

import pytest

import compare_answers


def write(path, answers):
    path.write_text(json.dumps({"answers": [
        dict(method=m, question_id=q, turn=t, temperature=0.0, ids=ids, equal_to_vanilla=eq)
        for m, q, t, ids, eq in answers]}))
    return path


def test_identical_runs_pass_and_a_changed_token_fails(tmp_path, capsys):
    before = write(tmp_path / "before.json", [("vanilla", 81, 0, [1, 2, 3], True), ("eagle3", 81, 0, [1, 2, 3], True),
                                              ("eagle3", 81, 1, [4, 5], True)])
    same = write(tmp_path / "same.json", [("eagle3", 81, 1, [4, 5], True), ("vanilla", 81, 0, [1, 2, 3], True),
                                          ("eagle3", 81, 0, [1, 2, 3], True), ("lookup", 82, 0, [7], True)])
    assert compare_answers.main([str(before), str(same), "--out", str(tmp_path / "summary.json")]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["methods"] == {"eagle3": dict(answers=2, identical=2), "vanilla": dict(answers=1, identical=1)}
    assert summary["only_in_one"] == 1 and summary["equal_to_plain"]["after"]["lookup"] == 1.0
    changed = write(tmp_path / "changed.json", [("vanilla", 81, 0, [1, 2, 3], True), ("eagle3", 81, 0, [1, 2, 4], False),
                                                ("eagle3", 81, 1, [4, 5], True)])
    assert compare_answers.main([str(before), str(changed)]) == 1
    assert "eagle3                 1/2" in capsys.readouterr().out


def test_runs_without_a_common_answer_fail_and_a_file_without_ids_is_a_one_line_error(tmp_path, capsys):
    a = write(tmp_path / "a.json", [("vanilla", 81, 0, [1], True)])
    b = write(tmp_path / "b.json", [("vanilla", 82, 0, [1], True)])
    assert compare_answers.main([str(a), str(b)]) == 1
    (tmp_path / "old.json").write_text(json.dumps({"answers": [dict(method="vanilla", question_id=81, turn=0,
                                                                    temperature=0.0)]}))
    with pytest.raises(SystemExit) as e:
        compare_answers.main([str(a), str(tmp_path / "old.json")])
    assert e.value.code == 2 and "not a benchmark JSON with token ids per answer (KeyError" in capsys.readouterr().err
