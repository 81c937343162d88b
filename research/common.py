"""What the research tools share: a report's header (the command and the machine) and its writing."""
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoshape import cpu_name  # noqa: E402


def run_header(script: str, argv) -> dict:
    """What every research report starts with: the command, when, and on what."""
    return dict(command=f"python research/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), hardware=cpu_name(),
                torch=torch.__version__, threads=torch.get_num_threads())


def write_report(out: Path, report: dict, title: str, lines: list):
    """OUT.json, and OUT.md (printed too): the title, the command and the machine, then lines."""
    markdown = "\n".join([f"# {title} ({report['threads']} threads, torch {report['torch']})", "",
                          f"- command: `{report['command']}`",
                          f"- hardware: {report['hardware']}; date {report['date']}", *lines]) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(str(out) + ".md").write_text(markdown)
    print(markdown)
