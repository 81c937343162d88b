"""The research tools' tests share tests/conftest.py: its fixtures and helpers (the tiny configs it
registers, tiny checkpoints, tiny targets and drafts) are loaded here under a name of their own,
since pytest gives every conftest.py outside a package the module name "conftest"; test modules
here import them with `from conftest import ...` as tests/ does."""
import importlib.util
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(_TESTS))  # test_train_eagle's helpers, for test_gpu_train_eagle3.py

if "tests_conftest" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("tests_conftest", _TESTS / "conftest.py")
    sys.modules["tests_conftest"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["tests_conftest"])

from tests_conftest import *  # noqa: E402,F401,F403
