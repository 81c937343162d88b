"""Compare the answers of two scripts/benchmark.py runs token for token: did a change of the code
change what any method answers? Each answer is keyed by (method, question, turn, temperature);
the ones both runs hold are compared by their token ids.

    python research/compare_answers.py BEFORE.json AFTER.json [--out SUMMARY.json]

Prints, per method, how many answers are identical, and each run's share equal to plain decoding.
Exits 1 when an answer differs (or the runs share none), 0 otherwise.
"""
import argparse
import json
import sys
from pathlib import Path


def load_run(path: Path) -> tuple:
    """A benchmark JSON's answers, {(method, question_id, turn, temperature): token ids}, and per
    method the share of them its benchmark found equal to plain decoding's."""
    try:
        ids, flags = {}, {}
        for a in json.loads(path.read_text())["answers"]:
            ids[a["method"], a["question_id"], a["turn"], a["temperature"]] = a["ids"]
            flags.setdefault(a["method"], []).append(bool(a["equal_to_vanilla"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a benchmark JSON with token ids per answer ({type(e).__name__}: {e})") from None
    return ids, {m: sum(f) / len(f) for m, f in flags.items()}


def compare(before: dict, after: dict) -> dict:
    """Per method: answers both runs hold, and how many of them are identical."""
    methods = {}
    for key in sorted(set(before) & set(after), key=str):
        m = methods.setdefault(key[0], dict(answers=0, identical=0))
        m["answers"] += 1
        m["identical"] += before[key] == after[key]
    return dict(methods=methods, only_in_one=len(set(before) ^ set(after)),
                identical=sum(m["identical"] for m in methods.values()),
                answers=sum(m["answers"] for m in methods.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--out", type=Path, help="write the summary here as JSON")
    args = p.parse_args(argv)
    try:
        (before, before_equal), (after, after_equal) = load_run(args.before), load_run(args.after)
    except ValueError as e:
        p.error(str(e))
    result = dict(compare(before, after), before=str(args.before), after=str(args.after),
                  equal_to_plain=dict(before=before_equal, after=after_equal))
    print(f"{result['identical']}/{result['answers']} answers identical token for token "
          f"({result['only_in_one']} in one run only)")
    for method, m in result["methods"].items():
        print(f"  {method:22s} {m['identical']}/{m['answers']}   equal to plain decoding: "
              f"before {before_equal[method]:.0%}, after {after_equal[method]:.0%}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["answers"] and result["identical"] == result["answers"] else 1


if __name__ == "__main__":
    sys.exit(main())
